"""Layout planner: enumerate every legal folded layout for a model on a cluster, rank by predicted step time.

A candidate is a :class:`~folding.planning.step_time.Plan`: attention TP·CP·DP·PP (+VPP), MoE
ETP·EP·EDP·PP, distributed optimizer on/off, recompute none/selective/moe/full. Legality is
:class:`folding.parallel.ParallelLayout`'s, plus what the model needs: TP divides the query and KV heads,
EP divides the experts, PP·VPP divides the layers (or, without VPP, an uneven first / last stage split:
:func:`_uneven_splits`; or, with ``pipeline_layouts``, a balanced ``parallel.pipeline_layout`` over
PP·VPP stages: :func:`_layout_variants`), DP divides the global batch, interleaving needs the
micro-batch count divisible by PP, CP splits the sequence into 2·CP causal chunks. TP and ETP stay inside
one NVLink domain. Each candidate gets a memory estimate from the one memory model,
:mod:`folding.planning.memory` (dropped when it does not fit, allocator overhead included) and a step time
(:mod:`folding.planning.step_time`), hence a predicted MFU. With ``memory_gib`` each layout instead gets the
fastest recompute and offload modules that fit that budget (:func:`cheapest_fit`,
:mod:`folding.planning.memory_fit`).

``COMPUTE_EFFICIENCY`` is the cost model's one calibrated constant (see :func:`calibrate_compute_efficiency`
and docs/planner.md): the fraction of peak BF16 FLOP/s that the matmuls reach.

Usage::

    results = plan_layouts(get_preset("mixtral_8x22b"), cluster=Cluster(gpu=get_gpu("h100"), num_gpus=128),
                           shape=TrainingShape(seq_length=4096, global_batch_size=256))
    results[0].plan, results[0].mfu, results[0].memory_gib
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from folding.model.config import ModelConfig, recompute_mode
from folding.parallel import LayoutError, ParallelLayout
from folding.parallel.pipeline_layout import balanced_layout

from .activations import RECOMPUTE_MODES
from .hardware import GIB, list_gpus
from .imbalance import LoadAt, RoutingModel
from .memory import MemoryEstimate, memory_per_rank, peak_candidate_stages
from .memory_fit import cheapest_setting, module_space
from .moe_overlap import memory_with_overlap
from .node_dispatch import DISPATCHERS
from .optim_precision import FIELDS as OPTIM_DTYPES
from .step_time import BF16, Cluster, Plan, StepTime, TrainingShape, estimate_step_time

#: Fraction of peak BF16 FLOP/s reached by the matmuls. Calibrated once, on one row only: Mixtral-8x22B on
#: 128 H100 (seq 4096, global batch 256), whose folded layout TP2 CP1 PP8 EP8 ETP1 the MoE Parallel Folding
#: paper measured at 49.3% MFU. Reproduce with ``calibrate_compute_efficiency`` (tests do).
COMPUTE_EFFICIENCY = 0.651

MATCH_KEYS = ("tp", "cp", "pp", "ep", "etp")


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _mapping(plan: Plan) -> tuple:
    return tuple(getattr(plan, k) for k in MATCH_KEYS)


def ep_in_dp(plan: Plan) -> bool:
    """Whether the expert-parallel group of ``plan`` sits inside one attention DP group (its ranks differ only
    in their DP coordinate), as in Megatron-Core without folding, rather than folded over the attention
    TP×CP×DP grid (spanning TP or CP ranks as well).

    Consecutive EP ranks are ``stride`` ranks apart: ETP when folded, TP·CP without folding (EP carved out
    of DP). With the order ``tp-cp-ep-dp-pp`` a rank's attention TP and CP coordinates are its remainder
    modulo TP·CP, so the group stays inside DP exactly when the stride is a multiple of TP·CP. Worked example
    on 128 GPUs: TP1 CP2 PP8 with ETP1 EP8 is folded over CP×DP (ranks 0..7: CP ranks 0 and 1 of four DP
    ranks), while the same sizes without folding put EP on ranks 0, 2, .., 14 (eight DP ranks of one CP rank).
    TP2 CP1 with ETP2 is in DP either way, which is why the two listings then print the same line.
    """
    stride = plan.etp if plan.folded else plan.tp * plan.cp
    return stride % (plan.tp * plan.cp) == 0


def describe_plan(plan: Plan) -> str:
    """The layout part of the planner's line: ``TP1 CP2 DP8 PP8 VPP7 | ETP1 EP8 EDP2 EP over TP·CP·DP``.

    The expert half ends with where EP sits (:func:`ep_in_dp`): ``EP in DP`` or ``EP over TP·CP·DP``
    (nothing for EP1), so that a folded and an unfolded layout of the same sizes never read alike unless
    their EP groups hold the same ranks.
    """
    vpp = f" VPP{plan.vpp}" if plan.vpp > 1 else ""
    ends = [(w, n) for w, n in (("first", plan.first_stage_layers), ("last", plan.last_stage_layers)) if n]
    if ends:
        vpp += " (" + ", ".join(f"{w} stage {n} layer{'' if n == 1 else 's'}" for w, n in ends) + ")"
    if plan.pipeline_layout is not None:
        vpp += f" (layout {plan.pipeline_layout})"
    where = "" if plan.ep == 1 else " EP in DP" if ep_in_dp(plan) else " EP over TP·CP·DP"
    return f"TP{plan.tp} CP{plan.cp} DP{plan.dp} PP{plan.pp}{vpp} | ETP{plan.etp} EP{plan.ep} EDP{plan.edp}{where}"


def plan_overrides(
    plan: Plan,
    *,
    cfg: Optional[ModelConfig] = None,
    cluster: Optional[Cluster] = None,
    shape: Optional[TrainingShape] = None,
) -> Optional[List[str]]:
    """The job's Hydra overrides that run ``plan``: ``parallel.tp/cp/pp/ep/etp``, ``parallel.vpp`` (when
    > 1), ``parallel.first/last_stage_layers`` and ``parallel.pipeline_layout`` (when set; the layout
    quoted for Hydra, its ``|``, ``(`` and ``*`` are not plain-value characters), the overlap knobs (when on),
    ``optim.distributed`` and ``train.recompute``. ``None`` for a plan of Megatron-Core without folding
    whose EP groups no engine layout has (EP carved out of DP while CP > 1: the engine's default order
    folds EP over CP ranks).

    With what the plan was made for, everything else it assumed, so that the job's dry run predicts the
    plan's memory: ``cfg`` adds ``model=<cfg.name>`` (a preset's name; fields changed from the preset are
    not written) and ``moe.dispatcher`` when the plan's differs from ``cfg``'s; ``cluster`` adds
    ``parallel.world_size``, ``parallel.gpu`` (a kind of the table) and ``parallel.nvlink_domain`` (the world
    when it is smaller: one node);
    ``shape`` adds ``train.precision=bf16`` (the planner's parameters and activations),
    ``train.seq_length``, ``train.global_batch_size``, ``train.micro_batch_size``, ``optim.name`` and the
    optimizer's dtypes (``optim.exp_avg_dtype`` ...), and ``moe.fp8_recipe`` when it plans FP8 experts.
    Two assumptions have no job setting: ``shape.fp8_dense`` (the engine's dense layers are bf16; time
    only) and ``shape.fused_swiglu=False`` (the engine's activation is fused: its dry run then predicts
    less activation memory than the plan)."""
    if not plan.folded and plan.ep > 1 and plan.cp > 1:
        return None
    out = [] if cfg is None else [f"model={cfg.name}"]
    if cluster is not None:
        out.append(f"parallel.world_size={cluster.num_gpus}")
        if cluster.gpu.name in list_gpus():
            out.append(f"parallel.gpu={cluster.gpu.name}")
        out.append(f"parallel.nvlink_domain={min(cluster.nvlink_domain, cluster.num_gpus)}")  # smaller world: 1 node
    out += [f"parallel.{k}={getattr(plan, k)}" for k in ("tp", "cp", "pp", "ep", "etp")]
    if plan.vpp > 1:
        out.append(f"parallel.vpp={plan.vpp}")
    for k in ("first_stage_layers", "last_stage_layers"):
        if getattr(plan, k) is not None:
            out.append(f"parallel.{k}={getattr(plan, k)}")
    if plan.pipeline_layout is not None:
        out.append(f"parallel.pipeline_layout='{plan.pipeline_layout}'")
    for k in ("overlap_moe_comm", "delay_wgrad"):
        if getattr(plan, k):
            out.append(f"parallel.{k}=true")
    out.append(f"optim.distributed={'true' if plan.distributed_optimizer else 'false'}")
    if shape is not None:
        prec = shape.optim_precision
        out.append(f"optim.name={prec.name}")
        out += [f"optim.{f}={getattr(prec, f)}" for f in OPTIM_DTYPES]
        out.append("train.precision=bf16")
        out += [f"train.{k}={getattr(shape, k)}" for k in ("seq_length", "global_batch_size", "micro_batch_size")]
    out += recompute_overrides(plan.recompute)
    if plan.offload:
        out.append(f"train.offload_modules=[{plan.offload}]")
    if cfg is not None and plan.dispatcher != cfg.moe.dispatcher:
        out.append(f"moe.dispatcher={plan.dispatcher}")
    if shape is not None and shape.fp8_recipe:
        out.append(f"moe.fp8_recipe={shape.fp8_recipe}")
    return out


def recompute_overrides(recompute: str) -> List[str]:
    """The job overrides of a recompute setting (:mod:`folding.model.recompute`): ``train.recompute=<mode>``
    for a mode, else ``train.recompute=none`` and ``train.recompute_modules=[...]``."""
    rc = recompute_mode(recompute)
    if rc.name in RECOMPUTE_MODES:
        return [f"train.recompute={rc.name}"]
    return ["train.recompute=none", f"train.recompute_modules=[{rc.name}]"]


# --------------------------------------------------------------------------------------------- memory
def plan_memory(cfg: ModelConfig, plan: Plan, *, shape: TrainingShape) -> MemoryEstimate:
    """Per-GPU memory of ``plan`` from the one memory model (:func:`folding.planning.memory.memory_per_rank`),
    on its worst pipeline stage: bf16 parameters, gradients, Adam state (sharded when
    ``plan.distributed_optimizer``), activations at the schedule's peak for ``plan.recompute`` and the
    step's micro-batch count, transients; optimizer state and gradients in ``shape.optim_precision``'s dtypes.

    Only the stages that can hold the most are evaluated (:func:`folding.planning.memory.peak_candidate_stages`):
    the first, the last (output layer, multi-token-prediction modules), and a middle stage only where its mix
    of dense and MoE layers differs from the first's; any other middle stage holds what an earlier one holds,
    with fewer micro-batches in flight. With ``plan.overlap_moe_comm`` each stage keeps what its longer
    warm-up holds in flight (:func:`folding.planning.moe_overlap.memory_with_overlap`). ``shape.fp8_recipe``
    is the job's ``moe.fp8_recipe`` (the run line writes it), which the memory model reads from the MoE record.
    """
    if shape.fp8_recipe and cfg.moe.fp8_recipe != shape.fp8_recipe:
        cfg = cfg.replace(moe=cfg.moe.replace(fp8_recipe=shape.fp8_recipe))
    m = shape.global_batch_size // (plan.dp * shape.micro_batch_size)
    kw = dict(
        param_bytes=BF16,
        distributed=plan.distributed_optimizer,
        recompute=plan.recompute,
        seq_length=shape.seq_length,
        micro_batch_size=shape.micro_batch_size,
        num_microbatches=m,
        fused_swiglu=shape.fused_swiglu,
        optim_precision=shape.optim_precision,
        offload=plan.offload,
    )
    per_stage = memory_with_overlap if plan.overlap_moe_comm else memory_per_rank
    ests = [per_stage(cfg, plan, stage=k, **kw) for k in peak_candidate_stages(cfg, plan)]
    return max(ests, key=lambda e: e.total)


# ------------------------------------------------------------------------------------------ enumeration
@functools.lru_cache(maxsize=None)
def _legal(world: int, tp: int, cp: int, pp: int, ep: int, etp: int, experts: int) -> bool:
    """ParallelLayout's verdict (VPP only adds "needs pp > 1", which the enumeration checks itself)."""
    try:
        ParallelLayout(world_size=world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, num_experts=experts)
    except LayoutError:
        return False
    return True


def _uneven_splits(num_layers: int, pp: int) -> List[Tuple[Optional[int], Optional[int]]]:
    """The ``(first_stage_layers, last_stage_layers)`` splits proposed when ``pp`` does not divide the
    layers (none otherwise; never with VPP):

    - the last stage takes the remainder of ``ceil(L/pp)``-layer stages (Megatron-Core's
      ``--decoder-last-pipeline-num-layers``), e.g. 61 layers on PP16 as 15 × 4 + 1;
    - the first and the last stage take the same number of layers, the largest that leaves the stages
      between an equal and larger share (with ``--decoder-first-pipeline-num-layers`` too), e.g. 94
      layers on PP16 as 5 + 14 × 6 + 5: the first stage, which holds the most micro-batches in flight
      under 1F1B, and the last, which also runs the output layer, hold fewer layers.
    """
    if pp < 2 or num_layers % pp == 0:
        return []
    out: List[Tuple[Optional[int], Optional[int]]] = []
    last = num_layers - (pp - 1) * -(-num_layers // pp)
    if last >= 1:
        out.append((None, last))
    for ends in range(num_layers // pp, 0, -1):
        between = num_layers - 2 * ends
        if pp > 2 and between % (pp - 2) == 0 and between // (pp - 2) > ends:
            out.append((ends, ends))
            break
    return out


def _layout_variants(cfg: ModelConfig, pp: int) -> List[Tuple[Tuple[Optional[int], Optional[int], str], int]]:
    """``((None, None, layout), vpp)`` for every VPP > 1 whose PP·VPP virtual stages do not divide the layers
    but take a balanced ``parallel.pipeline_layout``
    (:func:`folding.parallel.pipeline_layout.balanced_layout`: the embedding, each multi-token-prediction
    module and the loss count as one layer each), e.g. DeepSeek-V3's 61 layers on PP8 VPP4 as
    ``Et|(tt|)*30mL``."""
    if pp < 2:
        return []
    out = []
    slots = cfg.num_layers + cfg.mtp_num_layers + 2
    for vpp in range(2, slots // pp + 1):
        if cfg.num_layers % (pp * vpp) == 0:
            continue  # the even split of these stages is proposed already
        layout = balanced_layout(num_layers=cfg.num_layers, mtp_num_layers=cfg.mtp_num_layers, stages=pp * vpp)
        if layout is not None:
            out.append(((None, None, layout), vpp))
    return out


def enumerate_plans(
    cfg: ModelConfig,
    *,
    cluster: Cluster,
    shape: TrainingShape,
    folded: bool = True,
    overlap_moe_comm: bool = False,
    delay_wgrad: bool = False,
    dispatcher: str = "alltoall",
    pipeline_layouts: bool = False,
) -> Iterator[Plan]:
    """Every legal :class:`Plan` for ``cfg`` on ``cluster`` (see the module docstring for the rules).

    ``folded=False`` yields Megatron-Core's layouts without folding instead: ETP = TP and EP carved out of
    DP (DP divisible by EP), the dispatch group spanning TP·CP·EP ranks. ``overlap_moe_comm`` and
    ``delay_wgrad`` are set on every plan (``parallel.*`` of the same names), and ``dispatcher``
    (``moe.dispatcher``). ``pipeline_layouts``: also the balanced layouts of :func:`_layout_variants`.
    """
    N, dom = cluster.num_gpus, cluster.nvlink_domain
    S, B, b, L = shape.seq_length, shape.global_batch_size, shape.micro_batch_size, cfg.num_layers
    for tp in _divisors(min(N, dom)):
        if cfg.num_attention_heads % tp or cfg.num_kv_heads % tp:
            continue
        for cp in _divisors(N // tp):
            if S % (2 * cp) and cp > 1:
                continue
            for pp in _divisors(N // (tp * cp)):
                splits = _uneven_splits(L, pp)  # [(first, last)] when pp does not divide the layers
                layouts = _layout_variants(cfg, pp) if pipeline_layouts else []
                if L % pp and not splits and not layouts:
                    continue
                dp = N // (tp * cp * pp)
                if B % (dp * b):
                    continue
                m = B // (dp * b)
                # an uneven split has no VPP; an even one tries every VPP that divides its stages
                if splits:
                    variants = [((*ends, None), 1) for ends in splits]
                else:
                    variants = [((None, None, None), vpp) for vpp in _divisors(L // pp)] if L % pp == 0 else []
                for (first, last, layout), vpp in variants + layouts:
                    if vpp > 1 and (pp == 1 or m % pp):
                        continue
                    for ep in _divisors(cfg.moe.num_experts):
                        for etp in [tp] if not folded else _divisors(min(N, dom)):
                            if cfg.moe.ffn_hidden_size % etp:
                                continue
                            if not folded and dp % ep:
                                continue
                            if not _legal(N, tp, cp, pp, ep, etp, cfg.moe.num_experts):
                                continue
                            edp = N // (etp * ep * pp)
                            for dist in (True, False):
                                for rc in RECOMPUTE_MODES:
                                    yield Plan(
                                        tp=tp,
                                        cp=cp,
                                        pp=pp,
                                        vpp=vpp,
                                        last_stage_layers=last,
                                        first_stage_layers=first,
                                        pipeline_layout=layout,
                                        ep=ep,
                                        etp=etp,
                                        dp=dp,
                                        edp=edp,
                                        distributed_optimizer=dist,
                                        recompute=rc,
                                        folded=folded,
                                        overlap_moe_comm=overlap_moe_comm,
                                        delay_wgrad=delay_wgrad,
                                        dispatcher=dispatcher,
                                    )


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """One evaluated candidate."""

    plan: Plan
    """The layout and its knobs."""
    time: StepTime
    """Predicted step time, MFU and breakdown."""
    memory: MemoryEstimate
    """Per-GPU bytes of the worst pipeline stage (:func:`plan_memory`)."""
    routing: Optional["RoutedTimes"] = None
    """With a routing trace or skew: the step time at p50 and p99 of its steps (``time`` is the one ranked
    by); ``None``: balanced routing."""
    cfg: Optional[ModelConfig] = dataclasses.field(default=None, repr=False, compare=False)
    """The model planned (for :attr:`overrides`)."""
    cluster: Optional[Cluster] = dataclasses.field(default=None, repr=False, compare=False)
    """The GPUs planned for (for :attr:`overrides`)."""
    shape: Optional[TrainingShape] = dataclasses.field(default=None, repr=False, compare=False)
    """The step planned for (for :attr:`overrides`)."""

    @property
    def overrides(self) -> Optional[List[str]]:
        """The job overrides that run this plan as planned: :func:`plan_overrides` with the model, cluster and
        shape it was evaluated for (``None``: no engine layout places its EP groups)."""
        return plan_overrides(self.plan, cfg=self.cfg, cluster=self.cluster, shape=self.shape)

    @property
    def mfu(self) -> float:
        """Predicted MFU (fraction)."""
        return self.time.mfu

    @property
    def memory_gib(self) -> float:
        """Predicted peak per-GPU memory in GiB."""
        return self.memory.total / GIB

    def to_dict(self) -> dict:
        """A JSON-ready record: layout sizes, knobs, ``ep_placement`` (``"in_dp"`` or ``"folded"``, see
        :func:`ep_in_dp`; ``None`` for EP1), ``overrides`` (:attr:`overrides`, a list of strings),
        ``mfu`` (fraction), ``memory_gib``, ``step_s``."""
        d = dataclasses.asdict(self.plan)
        del d["folded"]  # where EP sits is ep_placement's one meaning
        d.update(
            ep_placement=None if self.plan.ep == 1 else "in_dp" if ep_in_dp(self.plan) else "folded",
            overrides=self.overrides,
            mfu=round(self.mfu, 4),
            memory_gib=round(self.memory_gib, 2),
            step_s=round(self.time.step_s, 4),
            step_breakdown_s={k: round(v, 4) for k, v in self.time.breakdown.items()},
            memory_breakdown_gib={k: round(v / GIB, 2) for k, v in self.memory.by_part().items()},
        )
        if self.routing is not None:
            d["routing"] = self.routing.to_dict()
        return d


@dataclasses.dataclass(frozen=True)
class RoutedTimes:
    """A layout's step time under imbalanced routing, at the p50 and p99 steps of the slowest EP rank's load."""

    p50: StepTime
    """Step time at the median step."""
    p99: StepTime
    """Step time at the 99th-percentile step."""
    load_p50: LoadAt
    """The slowest rank's load at the median step."""
    load_p99: LoadAt
    """The slowest rank's load at the 99th-percentile step."""

    def to_dict(self) -> dict:
        """JSON-ready: ``p50_step_s``, ``p99_step_s``, and per quantile ``max_over_mean`` (tokens per EP
        rank), ``compute`` / ``comm`` (the slowest rank's factors) and ``dropped`` (fraction)."""
        d = {"p50_step_s": round(self.p50.step_s, 4), "p99_step_s": round(self.p99.step_s, 4)}
        for q, load in (("p50", self.load_p50), ("p99", self.load_p99)):
            d[q] = {k: round(v, 4) for k, v in dataclasses.asdict(load).items()}
        return d


def routed_times(
    cfg: ModelConfig, plan: Plan, routing: RoutingModel, *, cluster: Cluster, shape: TrainingShape, eff: float
) -> RoutedTimes:
    """:class:`RoutedTimes` of ``plan``: the routing's p50 / p99 steps for its EP (experts placed in
    contiguous blocks), each step's load fed to :func:`~folding.planning.step_time.estimate_step_time`."""
    tok = shape.seq_length * shape.micro_batch_size / (plan.tp * plan.cp)
    rows = plan.etp * tok * cfg.moe.topk / (cfg.moe.num_experts // plan.ep)  # balanced, as step_time's
    loads = routing.at_quantiles(ep=plan.ep, rows_per_expert=rows)
    times = {
        q: estimate_step_time(
            cfg, plan, shape=shape, cluster=cluster, compute_efficiency=eff, moe_load=(a.compute, a.comm)
        )
        for q, a in loads.items()
    }
    return RoutedTimes(p50=times["p50"], p99=times["p99"], load_p50=loads["p50"], load_p99=loads["p99"])


def evaluate(
    cfg: ModelConfig,
    plan: Plan,
    *,
    cluster: Cluster,
    shape: TrainingShape,
    compute_efficiency: float = COMPUTE_EFFICIENCY,
    routing: Optional[RoutingModel] = None,
) -> PlanResult:
    """Memory and step time of one ``plan`` (whether it fits or not: see ``cluster.gpu.fits``); with
    ``routing``, the step time at its ``rank_by`` quantile (:func:`routed_times`)."""
    mem = plan_memory(cfg, plan, shape=shape)
    return _result(cfg, plan, mem, cluster=cluster, shape=shape, eff=compute_efficiency, routing=routing)


def _ranked_time(cfg, plan, *, cluster, shape, eff, routing) -> Tuple[StepTime, Optional[RoutedTimes]]:
    """The step time plans are ranked by (balanced, or at ``routing.rank_by``), and the routed times."""
    if routing is None:
        return estimate_step_time(cfg, plan, shape=shape, cluster=cluster, compute_efficiency=eff), None
    rt = routed_times(cfg, plan, routing, cluster=cluster, shape=shape, eff=eff)
    return getattr(rt, routing.rank_by), rt


def _result(cfg, plan, mem, *, cluster, shape, eff, routing) -> PlanResult:
    t, rt = _ranked_time(cfg, plan, cluster=cluster, shape=shape, eff=eff, routing=routing)
    return PlanResult(plan=plan, time=t, memory=mem, routing=rt, cfg=cfg, cluster=cluster, shape=shape)


def cheapest_fit(
    cfg: ModelConfig,
    plan: Plan,
    *,
    cluster: Cluster,
    shape: TrainingShape,
    memory_gib: Optional[float] = None,
    compute_efficiency: float = COMPUTE_EFFICIENCY,
    routing: Optional[RoutingModel] = None,
    bound_s: Optional[float] = None,
) -> Optional[PlanResult]:
    """``plan``'s layout with the recompute and offload modules of :mod:`folding.planning.memory_fit` (those
    that apply to ``cfg``, or ``train.recompute=full``) that give the smallest predicted step time (at
    ``routing``'s ``rank_by`` quantile with one) among those whose worst-stage peak (:func:`plan_memory`)
    fits ``memory_gib`` GiB of usable memory (the GPU's fit rule,
    :meth:`~folding.planning.hardware.GPUSpec.fits`; default: the GPU's usable memory); ``None`` when none
    fits or, with ``bound_s``, none as fast as ``bound_s`` seconds. ``plan``'s own recompute and offload are
    ignored."""
    return _cheapest(
        cfg,
        plan,
        cluster=cluster,
        shape=shape,
        memory_gib=memory_gib,
        eff=compute_efficiency,
        routing=routing,
        seconds=_seconds_of(cfg, cluster=cluster, shape=shape, eff=compute_efficiency, routing=routing),
        bound_s=bound_s,
    )


def _seconds_of(cfg, *, cluster, shape, eff, routing) -> Callable[[Plan], float]:
    """A plan's ranked step time in seconds (:func:`_ranked_time`), remembered for the plans asked again."""

    @functools.lru_cache(maxsize=None)
    def seconds(p: Plan) -> float:
        return _ranked_time(cfg, p, cluster=cluster, shape=shape, eff=eff, routing=routing)[0].step_s

    return seconds


def _cheapest(cfg, plan, *, cluster, shape, memory_gib, eff, routing, seconds, bound_s) -> Optional[PlanResult]:
    fit = cheapest_setting(
        plan,
        module_space(cfg),
        memory_of=lambda p: plan_memory(cfg, p, shape=shape),
        step_seconds=seconds,
        fits=lambda nbytes: cluster.gpu.fits(nbytes, usable_gib=memory_gib),
        bound_s=bound_s,
    )
    if fit is None:
        return None
    return _result(cfg, fit.plan, fit.memory, cluster=cluster, shape=shape, eff=eff, routing=routing)


def _fitted(cfg, plans, *, cluster, shape, memory_gib, eff, routing, distinct) -> Iterator[PlanResult]:
    """:func:`cheapest_fit` of each layout of ``plans`` (one search per layout covers every recompute mode).
    With ``distinct``, the layouts go from the fastest step without any module up, and each is searched
    only for settings as fast as the best of its mapping so far."""
    seconds = _seconds_of(cfg, cluster=cluster, shape=shape, eff=eff, routing=routing)
    layouts = [p for p in plans if p.recompute == "none"]
    fastest: Dict[tuple, float] = {}
    for plan in sorted(layouts, key=seconds) if distinct else layouts:
        key = _mapping(plan)
        r = _cheapest(
            cfg,
            plan,
            cluster=cluster,
            shape=shape,
            memory_gib=memory_gib,
            eff=eff,
            routing=routing,
            seconds=seconds,
            bound_s=fastest.get(key) if distinct else None,
        )
        if r is not None:
            fastest[key] = min(fastest.get(key, r.time.step_s), r.time.step_s)
            yield r


def plan_layouts(
    cfg: ModelConfig,
    *,
    cluster: Cluster,
    shape: TrainingShape,
    compute_efficiency: float = COMPUTE_EFFICIENCY,
    folded: bool = True,
    distinct: bool = True,
    overlap_moe_comm: bool = False,
    delay_wgrad: bool = False,
    routing: Optional[RoutingModel] = None,
    dispatcher: Optional[str] = None,
    pipeline_layouts: bool = False,
    memory_gib: Optional[float] = None,
) -> List[PlanResult]:
    """Every legal layout that fits in memory, fastest first.

    ``memory_gib``: each layout (with and without the distributed optimizer) gets the fastest recompute and
    offload modules whose peak fits that much usable memory (:func:`cheapest_fit`) instead of each recompute
    mode being tried on its own; ``None`` (the default): the modes ``none``, ``selective``, ``moe`` and
    ``full``, each kept when it fits the GPU's usable memory.

    ``dispatcher``: the token dispatcher planned for (:data:`folding.planning.node_dispatch.DISPATCHERS`);
    ``None`` reads ``cfg.moe.dispatcher`` (``allgather`` is planned as ``alltoall``, as it always was).

    ``routing``: rank by the step time at ``routing.rank_by`` (p50 or p99) of its steps' load on the
    slowest EP rank instead of balanced routing (:mod:`folding.planning.imbalance`); memory stays the
    balanced estimate.

    With ``distinct`` (the default) only the fastest variant (VPP, recompute, distributed optimizer) of each
    parallel mapping (TP, CP, PP, EP, ETP) is kept, so the list reads as a choice between mappings.
    ``overlap_moe_comm`` / ``delay_wgrad``: plan for ``parallel.overlap_moe_comm`` / ``parallel.delay_wgrad``
    (:mod:`folding.planning.moe_overlap`). ``pipeline_layouts``: also plan interleaved pipelines whose
    virtual stages do not divide the layers, with a balanced ``parallel.pipeline_layout``
    (:func:`_layout_variants`); a layout is a variant of its mapping like VPP.
    """
    _check_inputs(cfg, cluster, shape)
    if memory_gib is not None and not memory_gib > 0:
        raise ValueError(f"--memory-gib={memory_gib!r}: give the usable GiB per GPU, a positive number")
    best: Dict[tuple, PlanResult] = {}
    results: List[PlanResult] = []
    plans = enumerate_plans(
        cfg,
        cluster=cluster,
        shape=shape,
        folded=folded,
        overlap_moe_comm=overlap_moe_comm,
        delay_wgrad=delay_wgrad,
        dispatcher=planned_dispatcher(cfg, dispatcher),
        pipeline_layouts=pipeline_layouts,
    )
    if memory_gib is None:
        candidates = (
            _result(cfg, plan, mem, cluster=cluster, shape=shape, eff=compute_efficiency, routing=routing)
            for plan in plans
            for mem in [plan_memory(cfg, plan, shape=shape)]
            if cluster.gpu.fits(mem.total)
        )
    else:
        candidates = _fitted(
            cfg,
            plans,
            cluster=cluster,
            shape=shape,
            memory_gib=memory_gib,
            eff=compute_efficiency,
            routing=routing,
            distinct=distinct,
        )
    for r in candidates:
        if not distinct:
            results.append(r)
            continue
        key = _mapping(r.plan)
        if key not in best or _better(r, best[key]):
            best[key] = r
    results = results if not distinct else list(best.values())
    return sorted(results, key=lambda r: (r.time.step_s, r.memory_gib))


def planned_dispatcher(cfg: ModelConfig, dispatcher: Optional[str] = None) -> str:
    """The dispatcher the cost model plans for: ``dispatcher`` if given (one of
    :data:`~folding.planning.node_dispatch.DISPATCHERS`, else a ``ValueError`` naming ``--dispatcher``),
    otherwise ``cfg.moe.dispatcher``, with ``allgather`` planned as ``alltoall``."""
    if dispatcher is not None:
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"--dispatcher {dispatcher!r}: choose one of {', '.join(DISPATCHERS)}")
        return dispatcher
    return "hierarchical" if cfg.moe.dispatcher == "hierarchical" else "alltoall"


def _better(r: PlanResult, other: PlanResult) -> bool:
    """Whether ``r`` is faster than ``other`` or, as fast (within float round-off: two splits of the same
    work sum their stage times in different orders), smaller."""
    a, b = r.time.step_s, other.time.step_s
    if abs(a - b) > 1e-9 * max(a, b):
        return a < b
    return r.memory.total < other.memory.total


def _check_inputs(cfg: ModelConfig, cluster: Cluster, shape: TrainingShape) -> None:
    for name, v in (
        ("--world", cluster.num_gpus),
        ("--nvlink-domain", cluster.nvlink_domain),
        ("--seq-length", shape.seq_length),
        ("--global-batch-size", shape.global_batch_size),
        ("--micro-batch-size", shape.micro_batch_size),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an integer >= 1")
    if cluster.num_gpus > cluster.nvlink_domain and cluster.num_gpus % cluster.nvlink_domain:
        raise ValueError(
            f"--world={cluster.num_gpus} is not a whole number of NVLink domains of "
            f"--nvlink-domain={cluster.nvlink_domain}; use a multiple of it"
        )


def calibrate_compute_efficiency(
    cfg: ModelConfig,
    *,
    cluster: Cluster,
    shape: TrainingShape,
    mapping: Dict[str, int],
    target_mfu: float,
    require_fit: bool = True,
) -> float:
    """The ``compute_efficiency`` at which the best fitting variant of ``mapping`` predicts ``target_mfu``.

    ``mapping`` gives ``tp, cp, pp, ep, etp``; found by bisection (MFU rises monotonically with efficiency).
    ``require_fit=False`` takes the best variant whether or not this engine's memory model fits it (for a
    measurement made by another engine, whose activation memory differs).
    """
    want = tuple(mapping[k] for k in MATCH_KEYS)
    plans = [p for p in enumerate_plans(cfg, cluster=cluster, shape=shape) if _mapping(p) == want]
    if require_fit:
        plans = [p for p in plans if cluster.gpu.fits(plan_memory(cfg, p, shape=shape).total)]
    if not plans:
        raise ValueError(f"no legal layout that fits matches {mapping}")

    def best_mfu(eff: float) -> float:
        return max(estimate_step_time(cfg, p, shape=shape, cluster=cluster, compute_efficiency=eff).mfu for p in plans)

    lo, hi = 0.01, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if best_mfu(mid) < target_mfu else (lo, mid)
    return (lo + hi) / 2


def calibrate_fp8_efficiency(
    cfg: ModelConfig,
    *,
    cluster: Cluster,
    shape: TrainingShape,
    mapping: Dict[str, int],
    target_tflops: float,
    compute_efficiency: float = COMPUTE_EFFICIENCY,
) -> float:
    """The FP8 GEMM efficiency (:attr:`~folding.planning.hardware.GPUSpec.fp8_efficiency`) at which the best
    fitting variant of ``mapping`` predicts ``target_tflops`` model TFLOP/s per GPU with ``shape``'s FP8
    setting (``fp8_recipe``, ``fp8_dense``), the BF16 GEMMs at ``compute_efficiency``; by bisection."""
    if not shape.fp8_recipe:
        raise ValueError("calibrate_fp8_efficiency needs shape.fp8_recipe")
    want = tuple(mapping[k] for k in MATCH_KEYS)
    plans = [p for p in enumerate_plans(cfg, cluster=cluster, shape=shape) if _mapping(p) == want]
    plans = [p for p in plans if cluster.gpu.fits(plan_memory(cfg, p, shape=shape).total)]
    if not plans:
        raise ValueError(f"no legal layout that fits matches {mapping}")
    target_mfu = target_tflops * 1e12 / cluster.gpu.bf16_flops

    def best_mfu(eff: float) -> float:
        c = dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu, fp8_efficiency=eff))
        return max(
            estimate_step_time(cfg, p, shape=shape, cluster=c, compute_efficiency=compute_efficiency).mfu for p in plans
        )

    lo, hi = 0.01, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if best_mfu(mid) < target_mfu else (lo, mid)
    return (lo + hi) / 2
