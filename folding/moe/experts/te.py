"""TransformerEngine backend of the experts: ``GroupedLinear`` kernels inside one FP8 region.

Shape suffixes (docs/shapes.md): N rows sorted expert-major, Np padded rows, I input features, O output
features, L local experts.

Written against TransformerEngine 2.10–2.x (read at 2.20.2): ``te.GroupedLinear(num_gemms,
in_features, out_features, bias=, params_dtype=, device=, use_grouped_tensor=)`` whose
``forward(inp, m_splits, is_first_microbatch=)`` takes host row counts; ``te.autocast(enabled=,
recipe=, amax_reduction_group=)``; the recipes ``DelayedScaling``, ``Float8CurrentScaling``,
``Float8BlockScaling``, ``MXFP8BlockScaling``. Every TE callable and keyword the engine uses is in
:data:`TE_API`; ``tests/data/te_api_2.20.2.json`` records their signatures as parsed from TE's own
sources, and the unit tests check the engine's calls and the CPU stand-in of TE against it.

``use_grouped_tensor=False`` is passed explicitly: TE's native grouped-tensor path needs the row
counts as a CUDA tensor and raises on host ``m_splits``; left at ``None``, the deprecated environment
variable ``NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM`` would decide.

**One FP8 region per model-chunk forward.** On leaving the outermost FP8 region with the ``delayed``
recipe, TE all-reduces the amaxes of every module registered in its global buffer (each module
registers on its first FP8 forward, under the recipe and amax-reduction group of its region; not only
the modules run in this region) over that module's group, and updates their scales and histories.
:func:`fp8_region` is opened once per forward of a model chunk (``MoETransformer.stage_forward``)
with the data-parallel × context-parallel group of the chunk's ranks (the ranks that run the same
layers, so every rank of the group reduces the same modules in the same order), as Megatron-Core
does; the experts never open a region of their own for ``delayed`` (that would reduce per layer,
and over the world group by default: a hang with pipelining) and raise instead. Other recipes
reduce nothing on exit, so a standalone :class:`GroupedMLP` opens a local region for them. The
region also carries ``is_first_microbatch``, so TE quantizes the weights once per optimizer step and
reuses them for later micro-batches. TE keeps the region's state per process, not per thread (its
depth, the region's first FP8 module, the amax-reduction buffers), and the chunk's region spans the MoE
exchanges: it cannot open inside a pair of ``parallel.overlap_moe_comm``, whose other micro-batch would
run inside it (refused at validation; :func:`fp8_region` raises if reached).

**Weights.** The experts own ``fc1_weight [L, 2·Fl, H]`` / ``fc2_weight [L, H, Fl]``, stored alike for
every backend. The ``GroupedLinear`` modules are built on ``meta`` (TE allocates and initializes no
weight of its own) and used as kernels: before each call their ``weight{i}`` attributes are pointed
at the ``unbind`` of the packed weight (one autograd node, whose backward stacks the per-expert
gradients into one packed gradient; per-expert ``w[i]`` views would each allocate a zero tensor the
size of the whole weight in backward).

**FP8 state.** Only ``delayed`` has state (TE's ``get_extra_state`` is an empty tensor for the
stateless recipes). Its scales and amax histories are read from the modules' ``fp8_meta`` as plain
tensors (:data:`DELAYED_STATE`) and saved by the checkpoint in ``fp8/rank_<r>.pt``, not in any
``state_dict``; they are restored by allocating TE's meta tensors (``init_fp8_meta_tensors``, as
TE's own ``set_extra_state`` does) and copying into them. No pickle is handed to TE: since 2.20 its
``set_extra_state`` refuses a pickled ``delayed`` payload unless ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``.

**Padding.** FP8 grouped GEMMs need every expert's row count aligned (16 for FP8, 32 for MXFP8:
TE's ``get_align_size_for_quantization``). Rows are padded once before fc1 and the padding removed
once after fc2: the zero rows pass through SwiGLU as zeros (their probability is 0), so fc2 sees
the same aligned counts. The other two GEMM dimensions are checked at configuration time
(:mod:`folding.moe.experts.fp8_shapes`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Optional

import torch

from ...overlap.runtime import in_pair
from ..config import FP8_ROW_ALIGN  # noqa: F401 - re-exported: the recipes' row alignment

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
        "use_grouped_tensor",
    ),
    "transformer_engine.pytorch.GroupedLinear.forward": ("inp", "m_splits", "is_first_microbatch"),
    "transformer_engine.pytorch.GroupedLinear.init_fp8_meta_tensors": ("recipe",),
    "transformer_engine.pytorch.autocast": ("enabled", "recipe", "amax_reduction_group"),
    "transformer_engine.pytorch.is_fp8_available": ("return_reason",),
    "transformer_engine.pytorch.is_fp8_block_scaling_available": ("return_reason",),
    "transformer_engine.pytorch.is_mxfp8_available": ("return_reason",),
    "transformer_engine.common.recipe.DelayedScaling": (),
    "transformer_engine.common.recipe.Float8CurrentScaling": (),
    "transformer_engine.common.recipe.Float8BlockScaling": (),
    "transformer_engine.common.recipe.MXFP8BlockScaling": (),
}
"""Every TransformerEngine callable the engine calls, with the keywords it passes (all by keyword)."""

DELAYED_STATE = {
    "scale_fwd": ("scaling_fwd", "scale"),
    "amax_history_fwd": ("scaling_fwd", "amax_history"),
    "scale_bwd": ("scaling_bwd", "scale"),
    "amax_history_bwd": ("scaling_bwd", "amax_history"),
}
"""Where a TE module keeps the ``delayed`` recipe's state: saved name -> ``fp8_meta[key].attribute``
(the names TE's own ``get_extra_state`` gives them)."""

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
    if in_pair():
        raise RuntimeError(
            "a TransformerEngine FP8 region cannot open inside an overlap pair: TE keeps its FP8 autocast "
            "state per process, not per thread, and the other micro-batch of the pair would run inside it; "
            "set parallel.overlap_moe_comm=false, or moe.expert_backend=torch or emulated"
        )
    import transformer_engine.pytorch as te

    ctx = te.autocast(enabled=True, recipe=make_te_recipe(recipe_name), amax_reduction_group=amax_reduction_group)
    token = _REGION.set(_Region(recipe_name, first_microbatch))
    try:
        with ctx:
            yield
    finally:
        _REGION.reset(token)


def pad_rows_per_expert(x_NI: torch.Tensor, counts: list[int], multiple: int, min_rows: int = 0):
    """Zero-pad each expert's rows to a multiple of ``multiple``, and to at least ``min_rows`` (an
    expert without tokens then still has a group of zero rows: the FP8 grouped kernels refuse empty
    groups), by split/cat with host sizes (no index tensor). Returns ``(x_padded, padded_counts)``;
    :func:`unpad_rows_per_expert` undoes it."""
    padded = [max(-(-c // multiple) * multiple, min_rows) for c in counts]
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

    Held by :class:`~folding.moe.experts.grouped.GroupedMLP` outside its registered submodules (its
    ``state_dict`` has no TE entry); the ``delayed`` FP8 state travels by :meth:`delayed_state` /
    :meth:`load_delayed_state` into the checkpoint's ``fp8/rank_<r>.pt``. The modules hold no parameters.
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
                use_grouped_tensor=False,  # host m_splits: TE's split-quantize path
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

    def delayed_state(self) -> dict:
        """CPU copies of each module's ``delayed`` scales and amax histories, ``{gemm: {name: tensor}}``
        (names of :data:`DELAYED_STATE`); ``{}`` before the first FP8 forward allocated them."""
        out = {}
        for name, mod in self.gemms.items():
            meta = mod.fp8_meta
            if all(key in meta for key, _ in DELAYED_STATE.values()):
                out[name] = {
                    saved: getattr(meta[key], attr).detach().to("cpu", copy=True)
                    for saved, (key, attr) in DELAYED_STATE.items()
                }
        return out

    def load_delayed_state(self, state: dict) -> None:
        """Restore :meth:`delayed_state` without pickle: allocate each module's meta tensors for the
        ``delayed`` recipe (``init_fp8_meta_tensors``, as TE's ``set_extra_state`` does) and copy the
        saved tensors into them; the first FP8 forward keeps them (same recipe class)."""
        recipe = make_te_recipe("delayed")
        for name, saved in state.items():
            mod = self.gemms[name]
            mod.fp8_meta["recipe"] = recipe
            mod.fp8_meta["num_gemms"] = mod.num_gemms
            mod.init_fp8_meta_tensors(recipe=recipe)
            for saved_name, (key, attr) in DELAYED_STATE.items():
                dst, src = getattr(mod.fp8_meta[key], attr), saved[saved_name]
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(
                        f"checkpoint FP8 state {name}.{saved_name} has shape {tuple(src.shape)}, TE allocates "
                        f"{tuple(dst.shape)} (another amax_history_len or expert count); delete the checkpoint's "
                        "fp8/ directory to let TE recalibrate"
                    )
                with torch.no_grad():
                    dst.copy_(src)


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
            "full or moe, runs them outside it), open folding.moe.experts.te.fp8_region yourself, or choose "
            "a recipe without an amax history (moe.fp8_recipe=tensorwise, blockwise or mxfp8)"
        )
    with fp8_region(recipe_name, amax_reduction_group=None):
        yield
