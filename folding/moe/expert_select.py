"""Which expert backend runs where: the one place that decides, with TransformerEngine's own checks.

Backends: ``te`` (TransformerEngine ``GroupedLinear``, CUDA, BF16 or an FP8 recipe), ``torch``
(``torch._grouped_mm``, BF16/FP32), ``loop`` (one GEMM per expert, high precision), ``emulated``
(FP8 numerics on any device, one GEMM per expert). FP8 recipes: ``delayed``, ``tensorwise``,
``blockwise``, ``mxfp8``. TransformerEngine decides what the GPU supports: ``is_fp8_available``
(compute capability ≥ 8.9: ``delayed``, ``tensorwise``), ``is_fp8_block_scaling_available`` (≥ 9.0
and CUDA ≥ 12.9: ``blockwise``), ``is_mxfp8_available`` (≥ 10.0: ``mxfp8``).

``auto`` picks ``te`` only where TransformerEngine supports the recipe on this GPU, then ``torch``
(no recipe) or ``emulated`` (a recipe), then ``loop``. A fallback to a slower backend on a GPU is a
warning. An explicit backend that cannot run raises :class:`BackendError` naming the setting, the
reason (TE's, with the GPU's compute capability) and the fix, when the experts are built for a
device or when the job is validated, before any step.

Usage::

    ok, why = backend_support("te", "mxfp8", torch.device("cuda", 0))
    name = resolve_backend("auto", "mxfp8", torch.device("cuda", 0), torch.bfloat16)
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from ..quant.emulate import RECIPES
from .expert_backends import torch_grouped_mm_supported
from .expert_te import te_available, te_recipe_support

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
        if device.type != "cuda":
            return False, f"TransformerEngine runs on CUDA devices, not {device.type}"
        ok, why = te_available()
        if ok:
            ok, why = te_recipe_support(recipe)
        return ok, "" if ok else f"{why} ({_capability(device)})"
    if backend == "torch":
        if recipe is not None:
            return False, "the torch backend computes BF16/FP32 only; FP8 needs te (GPU) or emulated"
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
        fix = (
            "set moe.expert_backend=auto, or a recipe this GPU supports"
            if backend == "te"
            else "set moe.expert_backend=auto"
        )
        raise BackendError(
            f"moe.expert_backend={backend!r} with moe.fp8_recipe={recipe!r} cannot run on {device}: {why}; {fix}"
        )


def resolve_backend(backend: str, recipe: Optional[str], device: torch.device, dtype: torch.dtype) -> str:
    """The backend that runs: ``backend`` itself (checked), or ``auto``'s choice (module docstring)."""
    device = torch.device(device)
    if backend != "auto":
        check_backend(backend, recipe, device, dtype)
        return backend
    te_ok, te_why = backend_support("te", recipe, device, dtype)
    if te_ok:
        return "te"
    if recipe is not None:
        name = "emulated"
    else:
        name = "torch" if backend_support("torch", None, device, dtype)[0] else "loop"
    if device.type == "cuda":
        warnings.warn(
            f"moe.expert_backend=auto runs the {name} backend on {device} (slower than te): {te_why}",
            RuntimeWarning,
            stacklevel=2,
        )
    return name
