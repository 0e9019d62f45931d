"""Which expert backend runs where: the one place that decides, with TransformerEngine's own checks.

Backends: ``te`` (TransformerEngine ``GroupedLinear``, CUDA, BF16 or an FP8 recipe), ``torch``
(``torch._grouped_mm`` for BF16/FP32; ``torch._scaled_grouped_mm`` for the FP8 recipes ``rowwise``
and ``mxfp8``, :mod:`folding.moe.experts.scaled`), ``loop`` (one GEMM per expert, high precision),
``emulated`` (FP8 numerics on any device, one GEMM per expert). FP8 recipes: ``delayed``,
``tensorwise``, ``blockwise``, ``mxfp8``, ``rowwise``.

- TransformerEngine decides what the GPU supports: ``is_fp8_available`` (compute capability ≥ 8.9:
  ``delayed``, ``tensorwise``), ``is_fp8_block_scaling_available`` (≥ 9.0 and CUDA ≥ 12.9:
  ``blockwise``), ``is_mxfp8_available`` (≥ 10.0: ``mxfp8``). TE has no ``rowwise`` recipe.
- The ``torch`` backend runs ``rowwise`` on compute capability 9.x and ``mxfp8`` on 10.x, in bf16
  (:func:`folding.moe.experts.scaled.scaled_grouped_mm_support`, which also probes the kernel once).

``auto`` picks ``te`` where TransformerEngine supports the recipe on this GPU; else, with a recipe,
the ``torch`` FP8 path where it runs, else ``emulated``; without a recipe ``torch``, else ``loop``.
A fallback to ``emulated`` (or to ``torch``/``loop`` without a recipe) on a GPU is a warning. An
explicit backend that cannot run raises :class:`BackendError` naming the settings, the reason (TE's
or the kernel's, with the GPU's compute capability) and the fix, when the experts are built for a
device or when the job is validated for this machine, before any step.

Usage::

    ok, why = backend_support("te", "mxfp8", torch.device("cuda", 0))
    name = resolve_backend("auto", "rowwise", torch.device("cuda", 0), torch.bfloat16)
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from ...quant.emulate import RECIPES
from .backends import torch_grouped_mm_supported
from .scaled import TORCH_FP8_RECIPES, scaled_grouped_mm_support
from .te import te_available, te_recipe_support

BACKENDS = ("auto", "te", "torch", "loop", "emulated")
"""Names accepted by ``moe.expert_backend``."""


class BackendError(RuntimeError):
    """An expert backend / FP8 recipe combination this machine cannot run."""


def _capability(device: torch.device) -> str:
    if device.type != "cuda" or not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    return f"compute capability {major}.{minor}"


def backend_support(
    backend: str, recipe: Optional[str], device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> tuple[bool, str]:
    """Whether ``backend`` can run FP8 ``recipe`` (None: none) on ``device``; the reason when not."""
    device = torch.device(device)
    if backend not in BACKENDS or backend == "auto":
        raise ValueError(f"backend={backend!r}: choose one of {BACKENDS[1:]}")
    if recipe is not None and recipe not in RECIPES:
        raise ValueError(f"fp8_recipe={recipe!r}: choose one of {RECIPES} or None")
    if backend == "te":
        if recipe == "rowwise":
            return False, (
                "TransformerEngine has no rowwise recipe (its FP8 recipes are DelayedScaling, "
                "Float8CurrentScaling, Float8BlockScaling and MXFP8BlockScaling)"
            )
        if device.type != "cuda":
            return False, f"TransformerEngine runs on CUDA devices, not {device.type}"
        ok, why = te_available()
        if ok:
            ok, why = te_recipe_support(recipe)
        return ok, "" if ok else f"{why} ({_capability(device)})"
    if backend == "torch":
        if recipe is not None:
            return scaled_grouped_mm_support(recipe, device, dtype)
        ok = torch_grouped_mm_supported(device.type, dtype)
        return ok, "" if ok else f"torch {torch.__version__} has no working grouped_mm for {device.type}/{dtype}"
    if backend == "loop":
        return (
            recipe is None,
            ""
            if recipe is None
            else "the loop backend computes in high precision; use emulated or te for an FP8 recipe",
        )
    return (recipe is not None, "" if recipe is not None else "the emulated backend needs an fp8_recipe")


def check_backend(
    backend: str, recipe: Optional[str], device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> None:
    """Raise :class:`BackendError` if an explicit ``backend`` cannot run ``recipe`` on ``device``."""
    if backend == "auto":
        return
    ok, why = backend_support(backend, recipe, device, dtype)
    if not ok:
        raise BackendError(
            f"moe.expert_backend={backend!r} with moe.fp8_recipe={recipe!r} cannot run on {device}: {why}; "
            + _fix(backend, recipe)
        )


def _fix(backend: str, recipe: Optional[str]) -> str:
    """What to change when ``backend`` cannot run ``recipe`` here."""
    if backend == "te" and recipe == "rowwise":
        return (
            "set moe.expert_backend=torch (GPUs of compute capability 9.x) or auto, or choose a "
            "TransformerEngine recipe (moe.fp8_recipe=tensorwise, blockwise, mxfp8 or delayed)"
        )
    if backend == "te":
        return "set moe.expert_backend=auto, or a recipe this GPU supports"
    if backend == "torch" and recipe in TORCH_FP8_RECIPES:
        return (
            "run on a GPU with the kernel (compute capability 9.x for rowwise, 10.x for mxfp8) with "
            "train.precision=bf16, or set moe.expert_backend=emulated (the same numerics on any device, "
            "slowly) or moe.expert_backend=auto"
        )
    if backend == "torch" and recipe is not None:
        return "set moe.expert_backend=te or emulated (or auto), or moe.fp8_recipe=rowwise or mxfp8"
    return "set moe.expert_backend=auto"


def resolve_backend(backend: str, recipe: Optional[str], device: torch.device, dtype: torch.dtype) -> str:
    """The backend that runs: ``backend`` itself (checked), or ``auto``'s choice (module docstring)."""
    device = torch.device(device)
    if backend != "auto":
        check_backend(backend, recipe, device, dtype)
        return backend
    te_ok, te_why = backend_support("te", recipe, device, dtype)
    if te_ok:
        return "te"
    torch_ok, torch_why = backend_support("torch", recipe, device, dtype)
    if recipe is not None and torch_ok:
        return "torch"  # FP8 through torch._scaled_grouped_mm: not a fallback
    name = "torch" if torch_ok else ("emulated" if recipe is not None else "loop")
    why = te_why if torch_ok else f"{te_why}; {torch_why}"
    if device.type == "cuda":
        warnings.warn(
            f"moe.expert_backend=auto runs the {name} backend on {device} (slower than te): {why}",
            RuntimeWarning,
            stacklevel=2,
        )
    return name
