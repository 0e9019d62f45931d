"""TransformerEngine backend of the experts: ``GroupedLinear`` kernels inside one FP8 region.

Shape suffixes (docs/shapes.md): N rows sorted expert-major, Np padded rows, I input features, O output
features, L local experts.

Written against TransformerEngine 2.10–2.x (read at 2.20): ``te.GroupedLinear(num_gemms,
in_features, out_features, bias=, params_dtype=, device=)`` whose ``forward(inp, m_splits,
is_first_microbatch=)`` takes host row counts; ``te.autocast(enabled=, recipe=,
amax_reduction_group=)`` (``fp8_autocast(enabled=, fp8_recipe=, fp8_group=)`` before 2.10, used only
when ``autocast`` is missing); the recipes ``DelayedScaling``, ``Float8CurrentScaling``,
``Float8BlockScaling``, ``MXFP8BlockScaling``. Every TE callable and keyword the engine uses is in
:data:`TE_API`, which a test checks against the installed TransformerEngine.

**One FP8 region per model-chunk forward.** On leaving an FP8 region with the ``delayed`` recipe, TE
all-reduces the amax of every module used in it over the region's group and rolls their histories.
:func:`fp8_region` is opened once per forward of a model chunk (``MoETransformer.stage_forward``)
with the data-parallel × context-parallel group of the chunk's ranks (the ranks that run the same
layers), as Megatron-Core does; the experts never open a region of their own for ``delayed`` (that
would reduce per layer, and over the world group by default: a hang with pipelining) and raise
instead. Other recipes reduce nothing on exit, so a standalone :class:`GroupedMLP` opens a local
region for them. The region also carries ``is_first_microbatch``, so TE quantizes the weights once
per optimizer step and reuses them for later micro-batches.

**Weights.** The experts own ``fc1_weight [L, 2·Fl, H]`` / ``fc2_weight [L, H, Fl]``, stored alike for
every backend. The ``GroupedLinear`` modules are built on ``meta`` (TE allocates and initializes no
weight of its own) and used as kernels: before each call their ``weight{i}`` attributes are pointed
at the ``unbind`` of the packed weight (one autograd node, whose backward stacks the per-expert
gradients into one packed gradient; per-expert ``w[i]`` views would each allocate a zero tensor the
size of the whole weight in backward). TE's FP8 state (scales, amax histories: the modules'
``get_extra_state``) is part of :class:`GroupedMLP`'s ``state_dict``.

**Padding.** FP8 grouped GEMMs need every expert's row count aligned (16 for FP8, 32 for MXFP8).
Rows are padded once before fc1 and the padding removed once after fc2: the zero rows pass through
SwiGLU as zeros (their probability is 0), so fc2 sees the same aligned counts.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Optional

import torch

FP8_ROW_ALIGN = {"delayed": 16, "tensorwise": 16, "blockwise": 16, "mxfp8": 32, "rowwise": 16}
"""Per-expert row multiple that each FP8 recipe's grouped GEMM needs."""

TE_VERSION_RANGE = ">=2.10,<3"
"""TransformerEngine versions this backend was written against (``setup.py``'s ``te`` extra)."""

TE_API = {
    "transformer_engine.pytorch.GroupedLinear": (
        "num_gemms",
        "in_features",
        "out_features",
        "bias",
        "params_dtype",
        "device",
    ),
    "transformer_engine.pytorch.GroupedLinear.forward": ("inp", "m_splits", "is_first_microbatch"),
    "transformer_engine.pytorch.autocast": ("enabled", "recipe", "amax_reduction_group"),
    "transformer_engine.pytorch.is_fp8_available": ("return_reason",),
    "transformer_engine.pytorch.is_fp8_block_scaling_available": ("return_reason",),
    "transformer_engine.pytorch.is_mxfp8_available": ("return_reason",),
}
"""Every TransformerEngine callable the engine calls, with the keywords it passes."""

_TE_CHECK = {
    "delayed": "is_fp8_available",
    "tensorwise": "is_fp8_available",
    "blockwise": "is_fp8_block_scaling_available",
    "mxfp8": "is_mxfp8_available",
}


@dataclasses.dataclass(frozen=True)
class _Region:
    recipe: str
    first_microbatch: Optional[bool]


_REGION: contextvars.ContextVar = contextvars.ContextVar("folding_fp8_region", default=None)


def te_available() -> tuple[bool, str]:
    """``(True, "")`` when TransformerEngine imports and a CUDA device is present, else ``(False, why)``."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - report any import failure as the reason
        return False, f"transformer_engine.pytorch is not importable ({type(exc).__name__}: {exc})"
    return True, ""


def te_recipe_support(recipe_name: Optional[str]) -> tuple[bool, str]:
    """TransformerEngine's own verdict on ``recipe_name`` for the current GPU, with its reason
    (``is_fp8_available`` / ``is_fp8_block_scaling_available`` / ``is_mxfp8_available``)."""
    ok, why = te_available()
    if not ok or recipe_name is None:
        return ok, why
    import transformer_engine.pytorch as te

    check = getattr(te, _TE_CHECK[recipe_name])
    ok, why = check(return_reason=True)
    return bool(ok), why or ""


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


@contextlib.contextmanager
def fp8_region(recipe_name: Optional[str], *, amax_reduction_group, first_microbatch: Optional[bool] = None):
    """One TransformerEngine FP8 region around a model-chunk forward (a no-op when ``recipe_name`` is
    None). ``amax_reduction_group``: the data-parallel × context-parallel group of the chunk's
    ranks. ``first_microbatch``: True on the first micro-batch of an optimizer step, False on later
    ones (TE then reuses the FP8 weights), None when unknown."""
    if recipe_name is None:
        yield
        return
    import transformer_engine.pytorch as te

    recipe = make_te_recipe(recipe_name)
    if hasattr(te, "autocast"):
        ctx = te.autocast(enabled=True, recipe=recipe, amax_reduction_group=amax_reduction_group)
    else:  # TransformerEngine < 2.10
        ctx = te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=amax_reduction_group)
    token = _REGION.set(_Region(recipe_name, first_microbatch))
    try:
        with ctx:
            yield
    finally:
        _REGION.reset(token)


def pad_rows_per_expert(x_NI: torch.Tensor, counts: list[int], multiple: int):
    """Zero-pad each expert's rows to a multiple of ``multiple`` by split/cat with host sizes (no
    index tensor). Returns ``(x_padded, padded_counts)``; :func:`unpad_rows_per_expert` undoes it."""
    padded = [-(-c // multiple) * multiple for c in counts]
    if padded == list(counts):
        return x_NI, padded
    pieces = []
    for rows, c, p in zip(x_NI.split(list(counts)), counts, padded):
        pieces.append(rows)
        if p > c:
            pieces.append(x_NI.new_zeros((p - c, x_NI.shape[1])))
    return torch.cat(pieces), padded


def unpad_rows_per_expert(y_NpO: torch.Tensor, counts: list[int], padded: list[int]) -> torch.Tensor:
    """Drop the rows :func:`pad_rows_per_expert` added."""
    if padded == list(counts):
        return y_NpO
    return torch.cat([rows[:c] for rows, c in zip(y_NpO.split(padded), counts)])


class TEGroupedRunner(torch.nn.Module):
    """One TransformerEngine ``GroupedLinear`` per projection (fc1, fc2), used as kernels only.

    A submodule of :class:`~folding.moe.experts.GroupedMLP` so that the TE modules' FP8 state is in
    its ``state_dict`` (``_extra_state``); the modules hold no parameters.
    """

    def __init__(self, *, num_local_experts: int, hidden_size: int, ffn_local: int, params_dtype: torch.dtype):
        """Build the two ``GroupedLinear`` modules on ``meta``: TE allocates and initializes no weight."""
        super().__init__()
        import transformer_engine.pytorch as te

        self.num_local_experts = num_local_experts
        shapes = {"fc1": (hidden_size, 2 * ffn_local), "fc2": (ffn_local, hidden_size)}
        self.gemms = torch.nn.ModuleDict()
        for name, (k, o) in shapes.items():
            mod = te.GroupedLinear(
                num_gemms=num_local_experts,
                in_features=k,
                out_features=o,
                bias=False,
                params_dtype=params_dtype,
                device="meta",
            )
            for i in range(num_local_experts):
                del mod._parameters[f"weight{i}"]  # the experts own the weights
            self.gemms[name] = mod

    def linear(self, name: str, x_NI: torch.Tensor, w_LOI: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``y[rows of e] = x[rows of e] · w[e]ᵀ`` through ``GroupedLinear`` (rows already aligned)."""
        mod = self.gemms[name]
        for i, w in enumerate(w_LOI.unbind(0)):
            setattr(mod, f"weight{i}", w)
        region = _REGION.get()
        first = None if region is None else region.first_microbatch
        return mod(inp=x_NI, m_splits=counts, is_first_microbatch=first)


@contextlib.contextmanager
def expert_region(recipe_name: Optional[str]):
    """The region an expert forward runs in: the chunk's if one is open (its recipe must match), a
    local one for recipes that reduce nothing on exit, and an error for ``delayed`` outside one."""
    region = _REGION.get()
    if recipe_name is None or region is not None:
        if region is not None and region.recipe != recipe_name:
            raise RuntimeError(
                f"the FP8 region is open with recipe {region.recipe!r} but these experts use "
                f"fp8_recipe={recipe_name!r}; use one moe.fp8_recipe for the whole model"
            )
        yield
        return
    if recipe_name == "delayed":
        raise RuntimeError(
            "moe.fp8_recipe='delayed' with the te backend needs one FP8 region per model-chunk forward, "
            "with its amax reduced over the data-parallel x context-parallel group: run the experts "
            "through MoETransformer (which opens it; recomputing the experts in backward, train.recompute="
            "full or moe, runs them outside it), open folding.moe.expert_te.fp8_region yourself, or choose "
            "a recipe without an amax history (moe.fp8_recipe=tensorwise, blockwise or mxfp8)"
        )
    with fp8_region(recipe_name, amax_reduction_group=None):
        yield
