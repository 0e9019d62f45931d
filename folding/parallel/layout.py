"""The folded parallel layout: one frozen, validated object with the dense and the expert view.

Attention / dense layers use ``TP x CP x DP x PP``; MoE layers use ``ETP x EP x EDP x PP`` of the same
world. ``DP`` and ``EDP`` are derived from the world size. The layout is built once (from the config
and the world size), validated at construction, and passed by keyword to whoever needs it.

Usage::

    layout = ParallelLayout(world_size=8, tp=2, cp=2, ep=8, etp=1)
    layout.dp, layout.edp     # 2, 1
    layout.groups()           # every rank group of both generators (pure math)

Every impossible layout raises :class:`~folding.parallel.rank_math.LayoutError` naming the setting,
before any process group exists.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .pipeline_layout import check_pipeline_layout
from .rank_math import (
    LayoutError,
    attention_generator,
    expert_generator,
    layout_groups,
    node_split_groups,
    parse_order,
)

DEFAULT_ORDER = "tp-cp-ep-dp-pp"


def _check_size(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"parallel.{name}={value!r} must be an integer >= 1")


def _expert_size_fix(layout: "ParallelLayout", etp_defaulted: bool) -> str:
    """The fix for a world that ``etp*ep*pp`` does not divide: changing one setting at a time, the largest
    smaller ETP and the largest smaller EP that give a legal layout (experts divisible by EP included),
    and the world size that would fit as it is."""

    def legal(**change) -> bool:
        fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)}
        try:
            ParallelLayout(**{**fields, **change})
        except LayoutError:
            return False
        return True

    w, pp = layout.world_size, layout.pp
    # only sizes that divide the world are built (so this check is never reached again from here)
    etp = next((e for e in range(layout.etp - 1, 0, -1) if w % (e * layout.ep * pp) == 0 and legal(etp=e)), None)
    ep = next((e for e in range(layout.ep - 1, 0, -1) if w % (layout.etp * e * pp) == 0 and legal(ep=e)), None)
    fixes = [f"parallel.{name}={v}" for name, v in (("etp", etp), ("ep", ep)) if v is not None]
    text = "change etp, ep or pp" + (", e.g. " + " or ".join(fixes) if fixes else "")
    text += f" (or launch a multiple of {layout.etp * layout.ep * layout.pp} ranks)"
    if etp_defaulted and etp is not None:
        text += f"; etp defaults to tp={layout.tp}: set parallel.etp explicitly, e.g. parallel.etp={etp}"
    return text


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """A validated folded layout of ``world_size`` ranks.

    Fields are keyword-only; ``dp`` and ``edp`` are derived.
    """

    world_size: int
    """Number of ranks in the job (torchrun's WORLD_SIZE)."""
    tp: int = 1
    """Attention tensor-parallel size (sequence parallelism is implied when > 1)."""
    cp: int = 1
    """Attention context-parallel size (the sequence is split in load-balanced causal chunks)."""
    pp: int = 1
    """Pipeline-parallel size, shared by both views."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per rank (interleaved 1F1B); ``None`` or 1 means none. Needs pp > 1."""
    last_stage_layers: Optional[int] = None
    """Layers of the last pipeline stage, the other stages sharing the rest evenly (Megatron-Core's
    ``--decoder-last-pipeline-num-layers``; e.g. DeepSeek-V3's 61 layers on PP16: 15 × 4 + 1).
    ``None``: every virtual stage holds the same number of layers. Needs pp > 1 and no vpp."""
    first_stage_layers: Optional[int] = None
    """Layers of the first pipeline stage, the stages after it (up to ``last_stage_layers``) sharing
    the rest evenly (Megatron-Core's ``--decoder-first-pipeline-num-layers``; e.g. Qwen3-235B-A22B's 94
    layers on PP16: 5, 14 × 6, 5 with ``last_stage_layers=5``). Needs pp > 1 and no vpp."""
    pipeline_layout: Optional[str] = None
    """What every virtual stage holds, in Megatron-Core's ``--pipeline-model-parallel-layout`` syntax
    (:mod:`folding.parallel.pipeline_layout`: ``E`` embedding, ``t`` transformer layer, ``m``
    multi-token prediction, ``L`` loss, ``|`` between virtual stages, ``x*N`` / ``(...)*N`` repetition),
    e.g. ``Et|(tt|)*30mL``. Its number of stages over ``pp`` sets ``vpp`` (a given ``vpp`` must agree);
    not with ``first_stage_layers`` / ``last_stage_layers``. The layer and MTP counts are checked
    against the model where it is known (:func:`folding.parallel.partition.partition_layers`)."""
    ep: int = 1
    """Expert-parallel size: experts are split over EP ranks of the expert view."""
    etp: Optional[int] = None
    """Expert tensor-parallel size; ``None`` means "same as tp" (Megatron-Core's default)."""
    order: str = DEFAULT_ORDER
    """Axis order, fastest-varying first (Megatron-Core semantics)."""
    num_experts: Optional[int] = None
    """If given, checked for divisibility by ``ep``."""
    nvlink_domain: Optional[int] = None
    """Ranks per node (those that share the fast link; rank ``r`` is on node ``r // nvlink_domain``),
    for the hierarchical dispatcher's node and rail groups. ``None``: the world is one node. When
    set, it must divide the world and every node must hold the same number of ranks of each EP
    group (:func:`~folding.parallel.rank_math.node_split_groups`)."""

    def __post_init__(self):
        for name in ("world_size", "tp", "cp", "pp", "ep"):
            _check_size(name if name != "world_size" else "world_size", getattr(self, name))
        if self.pipeline_layout is not None:
            self._resolve_pipeline_layout()
        etp_defaulted = self.etp is None
        if etp_defaulted:
            object.__setattr__(self, "etp", self.tp)
        _check_size("etp", self.etp)
        if self.vpp is not None:
            _check_size("vpp", self.vpp)
            if self.vpp > 1 and self.pp == 1:
                raise LayoutError(
                    f"parallel.vpp={self.vpp} needs pipeline parallelism; set parallel.pp > 1 or parallel.vpp=null"
                )
        for name in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, name)
            if value is None:
                continue
            _check_size(name, value)
            if self.pp == 1 or (self.vpp or 1) > 1:
                raise LayoutError(
                    f"parallel.{name}={value} needs parallel.pp > 1 without "
                    f"parallel.vpp; set parallel.{name}=null or change pp/vpp"
                )
        parse_order(self.order)
        w = self.world_size
        if w % (self.tp * self.cp * self.pp):
            raise LayoutError(
                f"world size {w} is not divisible by parallel.tp*cp*pp = {self.tp}*{self.cp}*{self.pp} "
                f"= {self.tp * self.cp * self.pp}; change tp, cp or pp (or the number of ranks)"
            )
        if w % (self.etp * self.ep * self.pp):
            raise LayoutError(
                f"world size {w} is not divisible by parallel.etp*ep*pp = {self.etp}*{self.ep}*{self.pp} "
                f"= {self.etp * self.ep * self.pp}; {_expert_size_fix(self, etp_defaulted)}"
            )
        if self.num_experts is not None:
            _check_size("num_experts", self.num_experts)
            if self.num_experts % self.ep:
                raise LayoutError(
                    f"num_experts={self.num_experts} is not divisible by parallel.ep={self.ep}; "
                    f"choose ep among the divisors of {self.num_experts}"
                )
        att = attention_generator(self)
        exp = expert_generator(self)
        if self.nvlink_domain is not None:
            _check_size("nvlink_domain", self.nvlink_domain)
            if w % self.nvlink_domain:
                raise LayoutError(
                    f"parallel.nvlink_domain={self.nvlink_domain} does not divide the world size {w}; set it "
                    "to the ranks per node (torchrun's --nproc-per-node)"
                )
            node_split_groups(exp.get_ranks("ep"), self.nvlink_domain)
        names = att.order
        if self.pp > 1 and names.index("pp") != len(names) - 1 and self.edp != self.dp:
            raise LayoutError(
                f"parallel.order={self.order!r} does not put 'pp' last, which with pp={self.pp} requires "
                f"EDP == DP (got EDP={self.edp}, DP={self.dp}); put 'pp' last in parallel.order"
            )
        # with 'pp' the slowest axis both views give pp the stride world/pp, hence the same groups
        # {b + k*world/pp}: enumerating them (O(world) each time a layout is built) only matters otherwise
        if names[-1] != "pp" and att.get_ranks("pp") != exp.get_ranks("pp"):
            raise LayoutError(
                f"the attention and expert views give different pipeline groups under "
                f"parallel.order={self.order!r}; put 'pp' last in parallel.order"
            )

    def _resolve_pipeline_layout(self) -> None:
        """Check ``pipeline_layout``'s structure on ``pp`` ranks and set the ``vpp`` it implies."""
        for name in ("first_stage_layers", "last_stage_layers"):
            if getattr(self, name) is not None:
                raise LayoutError(
                    f"parallel.pipeline_layout={self.pipeline_layout!r} lists every stage's layers: it cannot be "
                    f"combined with parallel.{name}={getattr(self, name)}; set parallel.{name}=null"
                )
        if self.vpp is not None:
            _check_size("vpp", self.vpp)
        stages = check_pipeline_layout(self.pipeline_layout, pp=self.pp, vpp=self.vpp)
        if self.pp == 1 and len(stages) > 1:
            raise LayoutError(
                f"parallel.pipeline_layout={self.pipeline_layout!r} lists {len(stages)} virtual stages, which needs "
                "pipeline parallelism; set parallel.pp to a divisor of the stage count > 1, or list one stage"
            )
        if len(stages) > self.pp:
            object.__setattr__(self, "vpp", len(stages) // self.pp)

    @property
    def dp(self) -> int:
        """Attention data-parallel size: ``world / (tp*cp*pp)``."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        """Expert data-parallel size: ``world / (etp*ep*pp)``."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pipeline rank (``vpp`` or 1)."""
        return self.vpp or 1

    def groups(self):
        """All rank groups of both views (see :func:`~folding.parallel.rank_math.layout_groups`)."""
        return layout_groups(self)

    def describe(self) -> str:
        """One line such as ``attention TP2 CP2 DP2 PP1 | MoE ETP1 EP8 EDP1 PP1``."""
        v = f" VPP{self.vpp}" if self.vpp and self.vpp > 1 else ""
        ends = [
            f"{which} stage {n} layer{'' if n == 1 else 's'}"
            for which, n in (("first", self.first_stage_layers), ("last", self.last_stage_layers))
            if n is not None
        ]
        if self.pipeline_layout is not None:
            ends.append(f"layout {self.pipeline_layout}")
        if ends:
            v += f" ({', '.join(ends)})"
        return (
            f"attention TP{self.tp} CP{self.cp} DP{self.dp} PP{self.pp}{v} | "
            f"MoE ETP{self.etp} EP{self.ep} EDP{self.edp} PP{self.pp}"
        )
