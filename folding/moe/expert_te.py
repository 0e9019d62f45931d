"""TransformerEngine backend of the experts: ``GroupedLinear`` under ``fp8_autocast``.

Legend: N rows sorted expert-major, K input features, O output features, E local experts.

Written against TransformerEngine's documented PyTorch API:
``transformer_engine.pytorch.GroupedLinear(num_gemms, in_features, out_features, bias=...,
params_dtype=..., device=...)`` whose ``forward(inp, m_splits)`` takes the per-GEMM row counts,
``transformer_engine.pytorch.fp8_autocast(enabled=..., fp8_recipe=...)``, and the recipes of
``transformer_engine.common.recipe``: ``DelayedScaling``, ``Float8CurrentScaling``,
``Float8BlockScaling``, ``MXFP8BlockScaling``.

The experts keep their own ``fc1_weight [E, 2F, H]`` / ``fc2_weight [E, H, F]`` parameters so
that weights are stored identically whatever the backend; the ``GroupedLinear`` modules are used
as kernels only: before each call their ``weight{i}`` attributes are pointed at views of those
parameters (gradients flow back to them through autograd), and the modules' own weights are
released. FP8 GEMMs need every expert's row count aligned (16 for FP8, 32 for MXFP8): rows are
zero-padded per expert before and removed after (:func:`pad_rows_per_expert`).

Usage (inside :class:`folding.moe.experts.GroupedMLP`)::

    runner = TEGroupedRunner(num_local_experts=E, params_dtype=torch.bfloat16)
    with runner.autocast("mxfp8"):
        y_NO = runner.linear("fc1", x_NK, w_EOK, counts)
"""
from __future__ import annotations

import contextlib

import torch

FP8_ROW_ALIGN = {"delayed": 16, "tensorwise": 16, "blockwise": 16, "mxfp8": 32}
"""Per-expert row multiple that each FP8 recipe's grouped GEMM needs."""


def te_available() -> tuple[bool, str]:
    """``(True, "")`` when TransformerEngine imports and a CUDA device is present, else ``(False, why)``."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - report any import failure as the reason
        return False, f"transformer_engine.pytorch is not importable ({type(exc).__name__}: {exc})"
    return True, ""


def make_te_recipe(name: str):
    """The TransformerEngine recipe object for ``delayed``, ``tensorwise``, ``blockwise`` or ``mxfp8``."""
    from transformer_engine.common import recipe as te_recipe

    if name == "delayed":
        return te_recipe.DelayedScaling()
    if name == "tensorwise":
        return te_recipe.Float8CurrentScaling()
    if name == "blockwise":
        return te_recipe.Float8BlockScaling()
    if name == "mxfp8":
        return te_recipe.MXFP8BlockScaling()
    raise ValueError(f"fp8_recipe={name!r} is not one of {tuple(FP8_ROW_ALIGN)}")


def pad_rows_per_expert(x_NK: torch.Tensor, counts: list[int], multiple: int):
    """Zero-pad each expert's rows to a multiple of ``multiple``.

    Returns ``(x_padded, padded_counts, keep_index)`` where ``x_padded[keep_index] == x_NK``
    (``keep_index`` is an int64 tensor of the original rows' positions in the padded tensor).
    """
    padded = [((c + multiple - 1) // multiple) * multiple for c in counts]
    keep, src, dst = [], 0, 0
    for c, p in zip(counts, padded):
        keep.append(torch.arange(dst, dst + c, dtype=torch.int64))
        src += c
        dst += p
    keep_index = torch.cat(keep).to(x_NK.device) if keep else torch.zeros(0, dtype=torch.int64)
    x_padded = x_NK.new_zeros((dst, x_NK.shape[1])).index_copy(0, keep_index, x_NK)
    return x_padded, padded, keep_index


class TEGroupedRunner:
    """Holds one TransformerEngine ``GroupedLinear`` per projection (fc1, fc2), used as kernels only."""

    def __init__(self, *, num_local_experts: int, params_dtype: torch.dtype):
        """Create nothing yet: the ``GroupedLinear`` modules are built on first use, on the input's device."""
        self.num_local_experts = num_local_experts
        self.params_dtype = params_dtype
        self._modules: dict[str, torch.nn.Module] = {}

    def _module(self, name: str, in_features: int, out_features: int, device) -> torch.nn.Module:
        mod = self._modules.get(name)
        if mod is None:
            import transformer_engine.pytorch as te

            mod = te.GroupedLinear(
                self.num_local_experts,
                in_features,
                out_features,
                bias=False,
                params_dtype=self.params_dtype,
                device=device,
            )
            for i in range(self.num_local_experts):
                del mod._parameters[f"weight{i}"]  # the experts own the weights
            self._modules[name] = mod
        return mod

    @contextlib.contextmanager
    def autocast(self, recipe_name: str | None):
        """``fp8_autocast`` with the named recipe (a no-op context when ``recipe_name`` is None)."""
        if recipe_name is None:
            yield
            return
        import transformer_engine.pytorch as te

        recipe = make_te_recipe(recipe_name)
        if hasattr(te, "fp8_autocast"):
            ctx = te.fp8_autocast(enabled=True, fp8_recipe=recipe)
        else:  # releases that renamed it
            ctx = te.autocast(enabled=True, recipe=recipe)
        with ctx:
            yield

    def linear(self, name: str, x_NK: torch.Tensor, w_EOK: torch.Tensor, counts: list[int],
               recipe_name: str | None) -> torch.Tensor:
        """``y[rows of e] = x[rows of e] · w[e]ᵀ`` through ``GroupedLinear``, rows padded for FP8 alignment."""
        mod = self._module(name, w_EOK.shape[2], w_EOK.shape[1], x_NK.device)
        for i in range(self.num_local_experts):
            setattr(mod, f"weight{i}", w_EOK[i])
        if recipe_name is None:
            return mod(x_NK, counts)
        x_pad, padded, keep = pad_rows_per_expert(x_NK, counts, FP8_ROW_ALIGN[recipe_name])
        return mod(x_pad, padded).index_select(0, keep)
