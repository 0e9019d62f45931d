"""A CPU stand-in for the part of TransformerEngine 2.20 the engine uses, held to TE's recorded API.

Its classes and functions carry TE's exact signatures (names, order, defaults; the recipes' dataclass
fields), which ``tests/unit/test_te_snapshot.py`` compares with ``tests/data/te_api_2.20.2.json``
(parsed from TE's sources). Its behaviours are TE's recorded rules run by :mod:`tests.te_rules`:
``get_extra_state`` is an empty tensor unless the module ran FP8 with a stateful recipe (then a
pickled payload, as TE's); ``set_extra_state`` ignores, loads or refuses a payload as TE's loading
rule does (a pickled ``delayed`` payload needs ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``);
``GroupedLinear`` resolves ``use_grouped_tensor`` as TE does (``None``: the deprecated environment
variable), checks ``len(m_splits) == num_gemms``, takes the native path's CUDA ``m_splits`` rule
when ``use_grouped_tensor`` is on, and requires CUDA at construction and in forward unless a test
sets :data:`ALLOW_CPU` explicitly. Whenever FP8 is on, ``forward`` applies the shape rules the
snapshot records and refuses what TE's FP8 kernels cannot take: each split's rows a multiple of
``get_align_size_for_quantization`` (16; 32 for MXFP8), every forward and backward GEMM operand
passing ``fp8_gemm_dims``, and under MXFP8 ``mxfp8_is_quantizable``. ``delayed`` keeps
``fp8_meta["scaling_fwd"/"scaling_bwd"]`` with ``scale`` / ``amax_history`` of TE's shapes;
forwards write amaxes into the history, and leaving the outermost ``autocast`` updates every
module registered under the recipe and group. The autocast state is process-wide, shared by every
thread (:data:`_REGION`), as TE's ``FP8GlobalStateManager`` is: a region one thread opens is the region
of any other thread's modules until it closes. It records every call in :data:`CALLS`.

**Its numbers.** Without FP8 each GEMM is computed in the module's precision. Under FP8 it rounds as TE's
kernels do: every GEMM of forward and backward sees its operands quantized with the recipe's format and
scaling (``Float8CurrentScaling``: e4m3 per tensor, e5m2 gradients; ``Float8BlockScaling``: 1×128 blocks,
128×128 weight blocks; ``MXFP8BlockScaling``: 1×32 blocks with E8M0 ``rceil`` scales; 1-D blocks along each
GEMM's contraction) and accumulates in float32: :func:`folding.quant.emulated_linear`, the project's
emulation, per split. So the TE path's FP8 numerics are compared with the ``emulated`` expert backend's,
not with a high-precision product. ``DelayedScaling`` quantizes with the current per-tensor scale where TE
takes the one its amax history gave (the history is still kept and updated, as TE's): its codes match
TE's once the history holds the tensor's own amax. The amax history and the zero rows TE pads each split
with change no code: zeros raise no amax and pad only the last block of a split.

What it keeps for backward is TE's: under FP8 (and ``save_original_input=False``, the default) TE's
``_GroupedLinear.forward`` quantizes each split of its input for the forward GEMM (rowwise usage) and,
when the weights need a gradient, for the weight gradient (columnwise usage), drops the rowwise copy
after the GEMM (``update_usage(rowwise_usage=False, columnwise_usage=True)``) and saves the quantized
splits (``prepare_for_saving``): 1 byte per element plus the recipe's scales, never the high-precision
input. The emulation keeps the same (the columnwise copy; per-tensor codes are the same both ways) and
the weights, whose codes the backward makes again.

Usage (a pytest fixture installs it)::

    install(monkeypatch)          # sys.modules["transformer_engine..."] -> this stand-in
"""

from __future__ import annotations

import pickle
import sys
import types
from typing import Callable, Optional, Union

import torch

from folding.quant import emulated_linear
from tests.te_rules import Rules, load_snapshot
from tests.te_standin_recipes import (  # noqa: F401 - installed as transformer_engine.common.recipe
    RECIPE_MODULE,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    Recipe,
)

RULES = Rules(load_snapshot())
CALLS: list = []
"""Every call the engine made: ``("build", device)``, ``("gemm", m_splits, is_first_microbatch, kwargs)``,
``("enter", recipe class name, group)``, ``("exit",)``, ``("init_meta", recipe class name)``,
``("set_extra_state", state)``."""
SUPPORT: dict = {}
"""``is_*_available`` name -> ``(ok, reason)`` a test wants TE to answer (default: supported)."""
ALLOW_CPU = False
"""Explicit test flag: accept CPU (TE itself raises "TransformerEngine needs CUDA.")."""
_REGION = {"depth": 0, "recipe": None, "group": None, "first_module": False, "registered": {}}
"""TE's FP8 autocast state (its ``FP8GlobalStateManager``): one per process, shared by every thread, as
TE's is: the region's recipe and amax-reduction group, its depth, whether the region's first FP8 module
is still to run (that module's backward reduces the backward amaxes), and the amax buffers of every
module registered under a (recipe, group)."""
STANDS_IN_FOR = {
    "transformer_engine.pytorch.GroupedLinear": "GroupedLinear",
    "transformer_engine.pytorch.GroupedLinear.forward": "GroupedLinear.forward",
    "transformer_engine.pytorch.GroupedLinear.get_extra_state": "GroupedLinear.get_extra_state",
    "transformer_engine.pytorch.GroupedLinear.set_extra_state": "GroupedLinear.set_extra_state",
    "transformer_engine.pytorch.GroupedLinear.init_fp8_meta_tensors": "GroupedLinear.init_fp8_meta_tensors",
    "transformer_engine.pytorch.autocast": "autocast",
    "transformer_engine.pytorch.is_fp8_available": "is_fp8_available",
    "transformer_engine.pytorch.is_fp8_block_scaling_available": "is_fp8_block_scaling_available",
    "transformer_engine.pytorch.is_mxfp8_available": "is_mxfp8_available",
    "transformer_engine.common.recipe.DelayedScaling": "DelayedScaling",
    "transformer_engine.common.recipe.Float8CurrentScaling": "Float8CurrentScaling",
    "transformer_engine.common.recipe.Float8BlockScaling": "Float8BlockScaling",
    "transformer_engine.common.recipe.MXFP8BlockScaling": "MXFP8BlockScaling",
}
"""TE name -> the stand-in's definition (here, or a recipe in ``tests/te_standin_recipes.py``)."""


# ------------------------------------------------------------------------------ checks, autocast
def _support(name: str, return_reason: bool):
    ok, why = SUPPORT.get(name, (True, ""))
    return (ok, why) if return_reason else ok


def is_fp8_available(return_reason: bool = False):
    """TE's check for ``delayed`` / ``tensorwise`` (answer set by the test in :data:`SUPPORT`)."""
    return _support("is_fp8_available", return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False):
    """TE's check for ``blockwise``."""
    return _support("is_fp8_block_scaling_available", return_reason)


def is_mxfp8_available(return_reason: bool = False):
    """TE's check for ``mxfp8``."""
    return _support("is_mxfp8_available", return_reason)


class autocast:  # noqa: N801 - TE's name
    """TE's FP8 region over the process-wide :data:`_REGION`: entering saves the state and sets the
    recipe and group (the outermost entry also marks the region's first FP8 module as still to run);
    leaving restores the saved state, and leaving the outermost one updates every module registered (on
    its first ``delayed`` forward) under any recipe and group, as TE's global buffer does. Records
    entry and exit in :data:`CALLS`."""

    def __init__(
        self,
        enabled: bool = True,
        calibrating: bool = False,
        recipe: Optional["Recipe"] = None,
        amax_reduction_group: Optional["dist_group_type"] = None,  # noqa: F821 - TE's annotation
        _graph: bool = False,
    ) -> None:
        self._enabled, self._recipe, self._group, self._saved = enabled, recipe, amax_reduction_group, None

    def __enter__(self):
        CALLS.append(("enter", type(self._recipe).__name__, self._group))
        self._saved = (_REGION["recipe"], _REGION["group"], _REGION["first_module"])
        _REGION.update(recipe=self._recipe if self._enabled else None, group=self._group)
        if _REGION["depth"] == 0:
            _REGION["first_module"] = self._enabled
        _REGION["depth"] += 1
        return self

    def __exit__(self, *exc):
        _REGION["recipe"], _REGION["group"], _REGION["first_module"] = self._saved
        _REGION["depth"] -= 1
        CALLS.append(("exit",))
        if self._enabled and _REGION["depth"] == 0 and torch.is_grad_enabled():
            for modules in _REGION["registered"].values():
                for meta in modules:  # roll the history, scale from the newest amax (a simplified update)
                    st = meta["scaling_fwd"]
                    amax = st.amax_history[0].clone()
                    st.scale.copy_(torch.where(amax > 0, 448.0 / amax.clamp_min(1e-12), st.scale))
                    st.amax_history.copy_(torch.roll(st.amax_history, -1, 0))
                    st.amax_history[0].zero_()


# ------------------------------------------------------------------------------ GroupedLinear
class _State:
    def __init__(self, recipe, **buffers):
        self.recipe = recipe
        for k, v in buffers.items():
            setattr(self, k, v)


KEPT_FORMAT = {  # DelayedScaling: TE's delayed scale, here the current one (module docstring)
    "DelayedScaling": "tensorwise",
    "Float8CurrentScaling": "tensorwise",
    "Float8BlockScaling": "blockwise",
    "MXFP8BlockScaling": "mxfp8",
}
"""TE recipe class -> the recipe of :mod:`folding.quant.emulate` whose numerics its FP8 GEMMs have (and the
format of the input copy its ``_GroupedLinear`` keeps, columnwise usage: per tensor; 1×128 blocks and
MXFP8's 1×32 blocks along the rows)."""


EMULATED_FORMAT = {
    "DelayedScaling": Format.HYBRID,
    "Float8CurrentScaling": Format.HYBRID,
    "Float8BlockScaling": Format.E4M3,
    "MXFP8BlockScaling": Format.E4M3,
}
"""TE recipe class -> the ``fp8_format`` whose numerics :data:`KEPT_FORMAT`'s emulation has (TE's defaults:
HYBRID's e5m2 gradients for the per-tensor recipes, e4m3 everywhere for the block recipes). A recipe built
with another format is refused by name rather than rounded as if it had this one."""


def _fp8_gemms(inp, sizes, fmt, weights):
    """``y_i = q(x_i) · q(w_i)ᵀ`` per split with the FP8 numerics of ``fmt`` in forward and backward: each
    split is :func:`folding.quant.emulated_linear` (the project's emulation of a GPU FP8 GEMM: operands
    quantized as the recipe's table says, per GEMM along its contraction, accumulated in float32), which
    keeps what TE's FP8 ``_GroupedLinear`` keeps: the input as the weight gradient reads it (codes and
    scales, not the high-precision input) and the weights themselves."""
    return torch.cat([emulated_linear(x, w, fmt) for x, w in zip(inp.split(sizes), weights)])


class GroupedLinear(torch.nn.Module):
    """TE's ``GroupedLinear`` signature and checks; ``y_i = x_i · weight{i}ᵀ`` in high precision."""

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group: Optional["dist_group_type"] = None,  # noqa: F821 - TE's annotation
        tp_size: int = 1,
        get_rng_state_tracker: Optional[Callable] = None,
        rng_tracker_name: Optional[str] = None,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        device: Union[torch.device, str] = "cuda",
        ub_overlap_rs: bool = False,
        ub_overlap_ag: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool = False,
        name: Optional[str] = None,
        use_grouped_tensor: Optional[bool] = None,
    ) -> None:
        super().__init__()
        if not ALLOW_CPU:
            RULES.cuda_check("construct")
        CALLS.append(("build", str(device)))
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.save_original_input = save_original_input
        self.use_grouped_tensor = RULES.use_grouped_tensor(use_grouped_tensor)
        self.fp8, self.fp8_calibration, self.fp8_meta_tensors_initialized = False, False, False
        self.first_fp8_module = False  # the region's first FP8 module on its last forward (reduces bwd amax)
        self.fp8_meta = {"fp8_checkpoint": False, "fp8_group": None}
        dtype = params_dtype or torch.get_default_dtype()
        for i in range(num_gemms):
            # TE draws its weights with its init_method; any finite values do here (uninitialized memory
            # could hold NaN, which then reaches the amax history)
            w = torch.randn(out_features, in_features, device=device, dtype=dtype) * 0.02
            self.register_parameter(f"weight{i}", torch.nn.Parameter(w))

    def init_fp8_meta_tensors(self, recipe) -> None:
        """Allocate the recipe state per direction (``delayed``: TE's ``scale`` / ``amax_history``); an
        initialized ``delayed`` state of the same class is kept, as TE's ``set_meta_tensor`` does."""
        CALLS.append(("init_meta", type(recipe).__name__))
        for fwd in (True, False):
            key = RULES.meta_key(fwd)
            old = self.fp8_meta.get(key)
            if self.fp8_meta_tensors_initialized and old is not None and type(old.recipe) is type(recipe):
                continue
            buffers = RULES.delayed_buffers(recipe, self.fp8_meta["num_gemms"], fwd) if recipe.delayed() else {}
            self.fp8_meta[key] = _State(recipe, **buffers)
        self.fp8_meta_tensors_initialized = True

    def _init_fp8_metadata(self) -> None:
        recipe = _REGION["recipe"]
        self.fp8 = recipe is not None
        self.fp8_meta["fp8_checkpoint"] = self.fp8
        if not self.fp8:
            return
        self.fp8_meta["recipe"], self.fp8_meta["num_gemms"] = recipe, self.num_gemms
        self.fp8_meta["fp8_group"] = _REGION["group"]
        # TE's is_first_fp8_module(): read and cleared, process-wide
        self.first_fp8_module, _REGION["first_module"] = _REGION["first_module"], False
        self.init_fp8_meta_tensors(recipe)
        if recipe.delayed():
            key = (type(recipe).__name__, id(_REGION["group"]))
            registered = _REGION["registered"].setdefault(key, [])
            if not any(m is self.fp8_meta for m in registered):
                registered.append(self.fp8_meta)

    def forward(
        self,
        inp: torch.Tensor,
        m_splits: torch.Tensor,
        is_first_microbatch: Optional[bool] = None,
        out: Optional[torch.Tensor] = None,
        dgrad_out: Optional[torch.Tensor] = None,
    ):
        """TE's checks of ``m_splits`` and the device; under FP8 its shape rules (per split: row
        alignment, GEMM dimensions, MXFP8 quantizability, for the backward GEMMs too when a gradient
        will be taken); then the per-GEMM products."""
        splits = RULES.forward_checks(self, m_splits)
        if self.use_grouped_tensor:  # as on a GPU where TE's native path is supported
            RULES.native_path_check(splits)
        if not ALLOW_CPU:
            RULES.cuda_check("forward", inp=inp)
        self._init_fp8_metadata()
        sizes = splits.tolist()
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        if self.fp8:
            backward = torch.is_grad_enabled() and (inp.requires_grad or any(w.requires_grad for w in weights))
            RULES.fp8_shape_checks(self.fp8_meta["recipe"], sizes, self.out_features, self.in_features, backward)
        CALLS.append(("gemm", sizes, is_first_microbatch))
        if self.fp8 and self.fp8_meta["recipe"].delayed():
            amax = self.fp8_meta["scaling_fwd"].amax_history[0]
            for i, (x, w) in enumerate(zip(inp.split(sizes), weights)):
                amax[3 * i] = torch.maximum(amax[3 * i], x.detach().abs().amax() if x.numel() else amax[3 * i])
                amax[3 * i + 1] = w.detach().abs().amax()
        if self.fp8:
            recipe = self.fp8_meta["recipe"]
            name = type(recipe).__name__
            if recipe.fp8_format is not EMULATED_FORMAT[name]:
                raise NotImplementedError(
                    f"the TE stand-in rounds {name} with fp8_format={EMULATED_FORMAT[name].name} (the emulation's "
                    f"table), not {recipe.fp8_format.name}"
                )
            if not self.save_original_input:  # TE keeps only its quantized input
                return _fp8_gemms(inp, sizes, KEPT_FORMAT[name], weights)
            raise NotImplementedError("the TE stand-in models save_original_input=False (the engine's setting)")
        return torch.cat([x @ w.t() for x, w in zip(inp.split(sizes), weights)])

    def get_extra_state(self) -> torch.Tensor:
        """TE's rule: an empty tensor unless FP8 ran with a stateful recipe; then its pickled payload."""
        done, empty = RULES.get_extra_state_early(self)
        if done:
            return empty
        spec = RULES.snap["extra_state"]
        state = {"recipe": self.fp8_meta["recipe"]}
        for saved, (key, attr) in spec["delayed_tensors"].items():
            state[saved] = getattr(self.fp8_meta[key], attr).clone()
        state["extra_fp8_variables"] = {
            k: v for k, v in self.fp8_meta.items() if isinstance(v, (bool, int, float, str, tuple, list))
        }
        assert set(state) == set(spec["get_extra_state"]["payload_keys"])
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state: torch.Tensor) -> None:
        """TE's loading rule (ignore, load, or refuse without the unsafe-pickle opt-in), then restore."""
        CALLS.append(("set_extra_state", state))
        ignored, payload = RULES.set_extra_state_gate(self, state)
        if ignored or payload is None:
            return
        self.fp8_meta.update(payload["extra_fp8_variables"])
        self.fp8_meta["recipe"] = payload["recipe"]
        self.init_fp8_meta_tensors(payload["recipe"])
        for saved, (key, attr) in RULES.snap["extra_state"]["delayed_tensors"].items():
            getattr(self.fp8_meta[key], attr).copy_(payload[saved])


# ------------------------------------------------------------------------------ installation
def install(monkeypatch) -> None:
    """Put this stand-in where ``import transformer_engine.pytorch`` (and ``.common.recipe``) find it,
    reset its records, and let CPU through (:data:`ALLOW_CPU`), for one test."""
    te = types.ModuleType("transformer_engine")
    pt = types.ModuleType("transformer_engine.pytorch")
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType(RECIPE_MODULE)
    me = sys.modules[__name__]
    for te_name, local in STANDS_IN_FOR.items():
        if "." not in local:
            setattr(recipe if te_name.startswith(RECIPE_MODULE) else pt, local, getattr(me, local))
    recipe.Format, recipe.MMParams, recipe.Recipe = Format, MMParams, Recipe
    te.pytorch, te.common, common.recipe = pt, common, recipe
    for name, mod in [("transformer_engine", te), ("transformer_engine.pytorch", pt),
                      ("transformer_engine.common", common), (RECIPE_MODULE, recipe)]:  # fmt: skip
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(me, "ALLOW_CPU", True)
    for key, value in {"depth": 0, "recipe": None, "group": None, "first_module": False, "registered": {}}.items():
        monkeypatch.setitem(_REGION, key, value)
    CALLS.clear()
    SUPPORT.clear()
