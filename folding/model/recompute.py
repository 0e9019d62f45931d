"""What activation recompute runs again in backward: Megatron-Core's recompute modules, the one table.

``train.recompute_modules=[...]`` names modules with Megatron-Core's names and meaning
(``--recompute-granularity selective --recompute-modules``); ``train.recompute`` names a mode, a set of
them. A module either *discards* its output after the consumers' forward and refills it before their
backward (:mod:`folding.memory.discard`: nothing else changes, the module's own backward still has what
it kept), or *checkpoints* a region (``torch.utils.checkpoint``: only the region's inputs are kept and
its forward runs again in backward).

==================  =========  ==========================================================================
module              how        what is recomputed (and no longer kept)
==================  =========  ==========================================================================
``core_attn``       checkpoint the attention core (``softmax(QKᵀ)V``): the kernel's output and statistics
``layernorm``       discard    the outputs of the layer's two RMSNorms (recomputed from the kept inputs)
``moe_act``         discard    the experts' activation output (fc2's input), from fc1's kept output
``mla_up_proj``     discard    MLA's up-projections and RoPE: the queries, keys and values of the core
``mlp``             checkpoint the dense MLP of a dense layer (its input is kept)
``moe``             checkpoint the MoE block of an MoE layer: router, dispatch, experts, combine, shared expert
``shared_experts``  checkpoint the shared expert of an MoE layer
==================  =========  ==========================================================================

Modes (``train.recompute``): ``none``; ``selective`` = ``core_attn`` (Megatron-Core's default selective
set); ``moe`` = ``moe``; ``full`` = the whole layer, one checkpoint that keeps only the layer's input
(Megatron-Core's full granularity with the uniform method), which no module can be added to.

Three readers, one table: the model (:class:`folding.model.block.TransformerLayer` and the modules it
builds recompute what :class:`Recompute` says), the memory model (:mod:`folding.planning.activations`:
what a layer keeps and re-materializes) and the time models (:mod:`folding.planning.step_time`,
:mod:`folding.planning.flops`: the forwards run twice).

A recompute setting travels as one string: a mode, or modules (and at most one mode other than
``full``) joined by commas, e.g. ``"mla_up_proj,mlp"`` or ``"selective,moe_act"``.

Usage::

    rc = recompute_mode("selective,moe_act")
    rc.has("core_attn"), rc.has("moe_act")      # True, True
    recompute_spec("none", ["mla_up_proj", "mlp"]).name   # "mla_up_proj,mlp"
"""

from __future__ import annotations

import dataclasses
import functools
from typing import FrozenSet, Iterable, Optional

RECOMPUTE_MODULES = ("core_attn", "layernorm", "moe_act", "mla_up_proj", "mlp", "moe", "shared_experts")
"""Megatron-Core's recompute modules, in the table's order (``train.recompute_modules``)."""

DISCARDING = frozenset({"layernorm", "moe_act", "mla_up_proj"})
"""The modules that discard an output and refill it (the others checkpoint a region)."""

MODE_MODULES = {"none": (), "selective": ("core_attn",), "moe": ("moe",)}
"""The modules of each mode but ``full`` (the whole layer)."""

RECOMPUTE_MODES = ("none", "selective", "moe", "full")
"""The names ``train.recompute`` accepts, from the least recomputed to the most."""


@dataclasses.dataclass(frozen=True)
class Recompute:
    """What one recompute setting runs again in backward (the module docstring's table)."""

    modules: FrozenSet[str] = frozenset()
    """The recompute modules (:data:`RECOMPUTE_MODULES`)."""
    whole_layer: bool = False
    """Only the layer's input is kept: the whole layer is one recomputed region (``full``)."""

    def has(self, module: str) -> bool:
        """Whether ``module`` is one of the modules recomputed on their own (none under ``whole_layer``,
        where the layer's one checkpoint covers everything and no module acts inside it)."""
        if module not in RECOMPUTE_MODULES:
            raise ValueError(f"unknown recompute module {module!r}: choose among {', '.join(RECOMPUTE_MODULES)}")
        return module in self.modules

    @functools.cached_property
    def name(self) -> str:
        """The canonical string of this setting: a mode's name when it is one, else its modules in the
        table's order joined by commas (worked out once per record)."""
        if self.whole_layer:
            return "full"
        for mode, mods in MODE_MODULES.items():
            if self.modules == frozenset(mods):
                return mode
        return ",".join(m for m in RECOMPUTE_MODULES if m in self.modules)

    def mlp(self, *, moe_layer: bool) -> bool:
        """Whether the MLP sublayer of an MoE (``moe_layer``) or dense layer is checkpointed whole."""
        return self.has("moe") if moe_layer else self.has("mlp")


def recompute_spec(mode: str = "none", modules: Iterable[str] = ()) -> Recompute:
    """The :class:`Recompute` of ``train.recompute=mode`` with ``train.recompute_modules=modules`` added;
    ``ValueError`` naming the setting for an unknown name, or modules added to ``full``."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"train.recompute={mode!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
    modules = tuple(modules)
    bad = [m for m in modules if m not in RECOMPUTE_MODULES]
    if bad:
        raise ValueError(
            f"train.recompute_modules={list(modules)}: unknown module(s) {bad}; choose among "
            f"{', '.join(RECOMPUTE_MODULES)}"
        )
    if mode == "full":
        if modules:
            raise ValueError(
                f"train.recompute_modules={list(modules)} with train.recompute=full: the whole layer is "
                "already recomputed; set train.recompute=none to recompute only those modules"
            )
        return Recompute(whole_layer=True)
    return Recompute(modules=frozenset(MODE_MODULES[mode]) | frozenset(modules))


def recompute_mode(name) -> Recompute:
    """The :class:`Recompute` of a setting string (a mode, or modules and at most one mode joined by
    commas; see the module docstring) or of a :class:`Recompute` itself; ``ValueError`` naming
    ``train.recompute`` otherwise."""
    if isinstance(name, Recompute):
        return name
    if not isinstance(name, str):
        raise ValueError(f"train.recompute={name!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
    return _parse(name)


@functools.lru_cache(maxsize=4096)
def _parse(name: str) -> Recompute:
    """:func:`recompute_mode` of a string, parsed once (the planner asks for the same few settings millions
    of times)."""
    if not name:
        raise ValueError(f"train.recompute={name!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
    parts = [p.strip() for p in name.split(",")]
    modes = [p for p in parts if p in RECOMPUTE_MODES]
    if len(modes) > 1:
        raise ValueError(f"train.recompute={name!r}: name at most one of {', '.join(RECOMPUTE_MODES)}")
    if not modes and not all(p in RECOMPUTE_MODULES for p in parts):
        raise ValueError(
            f"train.recompute={name!r}: choose one of {', '.join(RECOMPUTE_MODES)} "
            f"(or modules among {', '.join(RECOMPUTE_MODULES)} through train.recompute_modules)"
        )
    return recompute_spec(modes[0] if modes else "none", [p for p in parts if p not in RECOMPUTE_MODES])


RECOMPUTE = {m: recompute_mode(m) for m in RECOMPUTE_MODES}
"""Every recompute mode by name."""

OFFLOAD_EMPTIED_BY = {
    "qkv_linear": ("layernorm", "QKV's input, the input norm's output, is recomputed"),
    "core_attn": ("core_attn", "the attention core is checkpointed (it keeps only its inputs)"),
    "expert_fc1": ("moe", "the MoE block is checkpointed (it keeps only its input)"),
    "moe_act": ("moe", "the MoE block is checkpointed (it keeps only its input)"),
}
"""Offload module -> (the recompute module that leaves it nothing to move, why)."""


def offload_conflict(rc: Recompute, offload) -> Optional[str]:
    """Why the offload modules ``offload`` cannot go with the recompute setting ``rc`` (``None`` when they
    can): ``full`` keeps only each layer's input; a recompute module may drop what an offload module would
    move (:data:`OFFLOAD_EMPTIED_BY`; ``mla_up_proj`` also recomputes the attention core's inputs)."""
    offload = list(offload)
    if not offload:
        return None
    if rc.whole_layer:
        return "train.recompute=full keeps only each layer's input: there is nothing to offload"
    emptied = dict(OFFLOAD_EMPTIED_BY)
    if "mla_up_proj" in rc.modules:
        emptied["core_attn"] = ("mla_up_proj", "the attention core's queries, keys and values are recomputed")
    for m in offload:
        if m in emptied and emptied[m][0] in rc.modules:
            return f"{m} has nothing to move while {emptied[m][0]} is recomputed ({emptied[m][1]})"
    return None
