"""The analytic model of per-rank memory: parameters, gradients, optimizer state, activations.

One function of (model config, layout, optimizer settings, recompute mode), shared by the memory
tests, the training dry run, ``tools/memory.py`` and the planner. Parameter counts follow the
parameter layout of ``folding`` exactly (what each rank holds under TP/SP, EP, ETP and PP); gradient
and optimizer bytes follow :class:`folding.optim.FoldedOptimizer`; activations are an estimate.

Per rank (``P_d`` dense and ``P_e`` expert parameters held by the rank, each part's share from the
parameter formulas of :class:`~folding.model.config.ModelConfig`, ``attention_params(tp)`` and the others):

- parameters: ``(P_d + P_e) * param_bytes``, except the routers' gating weights, which stay fp32
  whatever the parameter dtype (4 bytes each);
- gradients: main grads, ``4 * (P_d + P_e)`` (fp32; 2 with ``optim.main_grads_dtype=bf16``);
- optimizer: AdamW moments ``8`` bytes per element, plus ``4`` for fp32 master weights of the
  parameters that are not fp32 (other state dtypes:
  :class:`~folding.planning.optim_precision.OptimizerPrecision`, e.g. bf16 moments 4, fp8 moments
  ``2 * (1 + 4/128)``, bf16 master weights 0; ``optim.name=muon``: one fp32 momentum, 4 bytes, for
  Muon's matrices, AdamW's moments for :attr:`ParamCounts.adamw`, and Newton–Schulz transients
  :func:`~folding.planning.optim_precision.muon_transient_bytes`); with ``distributed`` (ZeRO-1)
  dense state is divided by ``DP*CP`` and
  expert state by ``EDP``. So expert parameters and gradients per rank scale as
  ``1/(EP*ETP*PP)``, and with ZeRO-1 the expert optimizer state as ``1/world`` (it does not shrink
  with EP at a fixed world size). Bucket padding (< one element per bucket per shard) is ignored.
- activations (estimate, bf16 by default, flash attention, sequence parallelism): per layer and
  micro-batch, with ``T = seq*mbs/(TP*CP)`` tokens per rank and ``R = T*top_k*ETP`` expert rows,
  see :mod:`folding.planning.activations`; times the layers of the stage (all its virtual stages: the
  split of ``first_stage_layers`` / ``last_stage_layers`` or of ``pipeline_layout``, zero-layer stages
  included) and the chunk forwards in flight over ``vpp`` (the rank's mean chunk) at the schedule's
  peak (1F1B: ``PP - stage`` micro-batches; interleaved: Megatron-Core's warm-up count, capped by the
  step's micro-batches); plus, on the last stage, the fused output
  layer + loss's input and one chunk of fp32 logits with their softmax.
- transient: the dispatcher's buffers of the layer being run and, under recompute, the region
  re-materialized in backward.
- multi-token prediction (``mtp_num_layers`` D): the D modules sit on the last virtual stage of the last
  pipeline rank: each one transformer layer (sharded as any layer) plus two input norms, the ``[H, 2H]``
  projection and an output norm, replicated over TP; with an untied embedding and PP > 1 that rank also
  holds its own copy of the embedding. Their activations (one micro-batch in flight: the last virtual
  stage runs each backward right after its forward) are added on that stage.

Parameters, gradients and optimizer state are exact (tested against measured buffers); activations
and transients are estimates (``seq_length=0`` leaves both out).

Usage::

    cfg = get_preset("mixtral_8x7b")
    layout = ParallelLayout(world_size=64, tp=1, pp=4, ep=8, etp=1)
    est = memory_per_rank(cfg, layout, param_bytes=2, distributed=True, recompute="selective",
                          seq_length=4096, micro_batch_size=1, num_microbatches=16)
    est.total / 2**30
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from folding.model.config import ModelConfig, recompute_mode
from folding.parallel.partition import layers_of, partition_layers

from .activations import (
    RECOMPUTE_MODES,
    activation_bytes_per_layer,
    activation_terms,
    in_flight_chunks,
    logits_bytes,
    mtp_activation_bytes,
    offload_set,
    offloaded_bytes_per_layer,
    rope_bytes,
    transient_bytes,
)
from .optim_precision import MUON_MOMENTUM_BYTES, OptimizerPrecision, muon_transient_bytes

Ends = Tuple[Optional[int], Optional[int], Optional[str]]
"""``(first_stage_layers, last_stage_layers, pipeline_layout)`` of a layout, ``None`` where unset: what
cuts the layers into stages besides ``pp`` and ``vpp``."""

__all__ = [
    "RECOMPUTE_MODES",
    "ParamCounts",
    "MemoryEstimate",
    "activation_bytes_per_layer",
    "activation_terms",
    "in_flight_chunks",
    "layers_on_stage",
    "logits_bytes",
    "memory_per_rank",
    "mtp_activation_bytes",
    "rope_bytes",
    "param_counts",
    "peak_candidate_stages",
    "stage_layers",
    "transient_bytes",
]


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """Parameter elements held by one rank."""

    dense: int
    """Dense elements (attention, norms, router, embeddings, dense/shared MLPs)."""
    expert: int
    """Routed-expert elements."""
    fp32: int = 0
    """Of the dense elements, those kept in fp32 whatever the parameter dtype (the routers' gating
    weights): 4 bytes each, and no fp32 master copy in the optimizer."""
    adamw: int = 0
    """Of the dense elements, those AdamW keeps under ``optim.name=muon`` (embedding and output copies,
    routers, shared-expert gates, the layers' and the final norms; biases and q/k or latent norms, under
    0.01% of a layer, are counted with Muon's): every other element, experts included, is Muon's."""


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by kind (the ``*_dense``/``*_expert`` split matches
    :meth:`folding.optim.FoldedOptimizer.memory_bytes`)."""

    params_dense: int
    """Dense parameter bytes."""
    params_expert: int
    """Expert parameter bytes."""
    grads_dense: int
    """fp32 main-gradient bytes of dense parameters."""
    grads_expert: int
    """fp32 main-gradient bytes of expert parameters."""
    optimizer_dense: int
    """AdamW moments (+ master weights) of dense parameters held by this rank."""
    optimizer_expert: int
    """AdamW moments (+ master weights) of expert parameters held by this rank."""
    activations: int
    """Estimated activation bytes kept for backward at the schedule's peak, the fused loss's chunk of fp32
    logits included on the last stage (0 when ``seq_length`` is 0)."""
    stage: int
    """The pipeline stage this estimate is for."""
    transient: int = 0
    """Estimated short-lived bytes at the peak: dispatch buffers and the recomputed region (0 when
    ``seq_length`` is 0), and under ``optim.name=muon`` the Newton–Schulz working set."""
    host: int = 0
    """Host (pinned) memory the offloaded activations take at the peak (``train.offload_modules``); not
    part of :attr:`total`, which is the device's."""

    @property
    def total(self) -> int:
        """Sum of every kind."""
        return (
            self.params_dense
            + self.params_expert
            + self.grads_dense
            + self.grads_expert
            + self.optimizer_dense
            + self.optimizer_expert
            + self.activations
            + self.transient
        )

    def by_part(self) -> Dict[str, int]:
        """Bytes grouped as ``params, grads, optimizer, activations, transient`` (dense + expert)."""
        return {
            "params": self.params_dense + self.params_expert,
            "grads": self.grads_dense + self.grads_expert,
            "optimizer": self.optimizer_dense + self.optimizer_expert,
            "activations": self.activations,
            "transient": self.transient,
        }

    def as_dict(self) -> Dict[str, int]:
        """Every field plus ``total``."""
        d = dataclasses.asdict(self)
        d["total"] = self.total
        return d


def stage_layers(cfg: ModelConfig, layout, stage: int, stages: Optional[Sequence[Tuple[int, int]]] = None) -> List[int]:
    """Decoder layer indices held by pipeline rank ``stage`` (all its virtual chunks; the
    multi-token-prediction layers, numbered after the decoder's, come on top on the last rank). ``stages``: the
    ``[start, end)`` of every virtual stage (default: :func:`folding.parallel.partition.partition_layers`)."""
    if stages is None:
        ends = _ends(layout)
        return list(_default_stage_layers(cfg.num_layers, layout.pp, layout.vpp or 1, stage, ends, cfg.mtp_num_layers))
    out: List[int] = []
    for chunk in range(len(stages) // layout.pp):
        out.extend(layers_of(rank=stage, chunk=chunk, pp=layout.pp, stages=list(stages)))
    return out


@functools.lru_cache(maxsize=65536)
def _partition(num_layers: int, pp: int, vpp: int, ends: Ends, mtp_num_layers: int) -> List[Tuple[int, int]]:
    """The layer ranges of every virtual stage (:func:`folding.parallel.partition.partition_layers`) of a
    layout given by its sizes and ``ends`` (first / last stage layers, pipeline layout), cached."""
    return partition_layers(
        num_layers=num_layers,
        pp=pp,
        vpp=vpp if vpp > 1 else None,
        first_stage_layers=ends[0],
        last_stage_layers=ends[1],
        pipeline_layout=ends[2],
        mtp_num_layers=mtp_num_layers,
    )


@functools.lru_cache(maxsize=65536)
def _default_stage_layers(
    num_layers: int, pp: int, vpp: int, stage: int, ends: Ends = (None, None, None), mtp_num_layers: int = 0
) -> Tuple[int, ...]:
    stages = _partition(num_layers, pp, vpp, ends, mtp_num_layers)
    out: List[int] = []
    for chunk in range(len(stages) // pp):
        out.extend(layers_of(rank=stage, chunk=chunk, pp=pp, stages=stages))
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def _busy_chunks(cfg: ModelConfig, pp: int, vpp: int, stage: int, ends: Ends) -> int:
    """How many of pipeline rank ``stage``'s ``vpp`` chunks hold a transformer layer (the last virtual stage
    also counts when the model has MTP modules, which run there): the chunk forwards that keep RoPE tables."""
    stages = _partition(cfg.num_layers, pp, vpp, ends, cfg.mtp_num_layers)
    last = len(stages) - 1
    return sum(
        1
        for c in range(len(stages) // pp)
        if stages[c * pp + stage][1] > stages[c * pp + stage][0] or (c * pp + stage == last and cfg.mtp_num_layers)
    )


def peak_candidate_stages(cfg: ModelConfig, layout) -> List[int]:
    """The pipeline ranks one of which holds the most memory: the first, the last, and, among the others,
    the first rank of each distinct mix of (layers, dense layers) under the layout's partition (a later rank
    with the same mix holds the same parameters and fewer micro-batches in flight). With dense layers only
    at the start (DeepSeek-V3) a middle rank can hold more experts than the first."""
    return list(_peak_candidates(cfg, layout.pp, layout.vpp or 1, _ends(layout)))


@functools.lru_cache(maxsize=65536)
def _peak_candidates(cfg: ModelConfig, pp: int, vpp: int, ends: Ends) -> Tuple[int, ...]:
    """:func:`peak_candidate_stages` of a layout given by its sizes and ``ends``, cached."""
    out, seen = [0], set()
    for k in range(1, pp - 1):
        mix = _stage_counts(cfg, pp, vpp, k, ends)
        if mix not in seen and mix != _stage_counts(cfg, pp, vpp, 0, ends):
            seen.add(mix)
            out.append(k)
    return tuple(sorted(set(out) | {pp - 1}))


def layers_on_stage(cfg: ModelConfig, layout, stage: int) -> int:
    """Number of layers on pipeline rank ``stage`` (the layout's partition)."""
    return len(stage_layers(cfg, layout, stage))


def param_counts(
    cfg: ModelConfig, layout, *, stage: int = 0, stages: Optional[Sequence[Tuple[int, int]]] = None
) -> ParamCounts:
    """Parameter elements on one rank of pipeline ``stage`` under ``layout`` (a ParallelLayout);
    ``stages`` as in :func:`stage_layers`."""
    if stages is None:
        return _param_counts(cfg, layout.tp, layout.pp, layout.vpp or 1, layout.ep, layout.etp, stage, _ends(layout))
    return _param_counts_of(
        cfg, layout.tp, layout.pp, layout.ep, layout.etp, stage, stage_layers(cfg, layout, stage, stages)
    )


def _ends(layout) -> Ends:
    """The layout's ``(first_stage_layers, last_stage_layers, pipeline_layout)`` (planner plans and
    layouts; ``None`` where it has none)."""
    return (
        getattr(layout, "first_stage_layers", None),
        getattr(layout, "last_stage_layers", None),
        getattr(layout, "pipeline_layout", None),
    )


def _stage_counts(cfg: ModelConfig, pp: int, vpp: int, stage: int, ends: Ends = (None, None, None)) -> Tuple[int, int]:
    """(layers, dense layers) on pipeline rank ``stage`` under the default partition, cached."""
    return _stage_counts_cached(cfg, pp, vpp, stage, ends)


@functools.lru_cache(maxsize=65536)
def _stage_counts_cached(cfg: ModelConfig, pp: int, vpp: int, stage: int, ends: Ends) -> Tuple[int, int]:
    mine = _default_stage_layers(cfg.num_layers, pp, vpp, stage, ends, cfg.mtp_num_layers)
    return len(mine), sum(1 for i in mine if not cfg.is_moe_layer(i))


@functools.lru_cache(maxsize=65536)
def _param_counts(
    cfg: ModelConfig, tp: int, pp: int, vpp: int, ep: int, etp: int, stage: int, ends: Ends = (None, None, None)
) -> ParamCounts:
    mine = _default_stage_layers(cfg.num_layers, pp, vpp, stage, ends, cfg.mtp_num_layers)
    return _param_counts_of(cfg, tp, pp, ep, etp, stage, mine)


def _param_counts_of(
    cfg: ModelConfig, tp: int, pp: int, ep: int, etp: int, stage: int, mine: Sequence[int]
) -> ParamCounts:
    first, last = stage == 0, stage == pp - 1
    if last:  # the multi-token-prediction layers run on the last virtual stage, after the decoder's
        mine = [*mine, *cfg.layer_numbers()[cfg.num_layers :]]
    n_moe = sum(1 for i in mine if cfg.is_moe_layer(i))
    dense = sum(cfg.layer_params(i, tp) for i in mine)
    experts = cfg.routed_experts_params(ep=ep, etp=etp)
    emb = cfg.embedding_params(tp)
    H = cfg.hidden_size
    gate = H if cfg.moe.shared_expert_ffn_hidden_size and cfg.moe.shared_expert_gate else 0
    adamw = 2 * H * len(mine) + n_moe * (cfg.router_params() + gate)  # two norms per layer; router, gate
    if first:
        dense += emb
        adamw += emb
    if last:
        dense += cfg.hidden_size  # final norm
        adamw += cfg.hidden_size
        if not cfg.tie_embeddings or not first:
            dense += emb  # output layer (or tied copy)
            adamw += emb
        dense += cfg.mtp_params()
        adamw += 3 * H * cfg.mtp_num_layers
        if cfg.mtp_num_layers and not cfg.tie_embeddings and not first:
            dense += emb  # the last stage's own copy of the (untied) embedding, for the MTP inputs
            adamw += emb
    return ParamCounts(dense=dense, expert=n_moe * experts, fp32=n_moe * cfg.router_params(), adamw=adamw)


def memory_per_rank(
    cfg: ModelConfig,
    layout,
    *,
    param_bytes: int = 2,
    distributed: bool = False,
    recompute: str = "none",
    seq_length: int = 0,
    micro_batch_size: int = 1,
    act_bytes: int = 2,
    stage: Optional[int] = None,
    num_microbatches: Optional[int] = None,
    fused_swiglu: bool = True,
    overlap_moe_comm: bool = False,
    optim_precision: Optional[OptimizerPrecision] = None,
    offload="",
) -> MemoryEstimate:
    """Bytes per rank on pipeline ``stage`` (``None``: the stage with the largest total).

    ``layout``: a :class:`~folding.parallel.ParallelLayout` (or any object with its ``tp, cp, pp, vpp,
    ep, etp, dp, edp``). ``param_bytes``: 4 for fp32 parameters, 2 for bf16 (then fp32 master weights
    are added to the optimizer state); ``distributed``: ZeRO-1 (``optim.distributed``);
    ``recompute``: ``train.recompute`` (none, selective, moe, full); ``seq_length=0`` leaves
    activations and transients out; ``num_microbatches``: micro-batches per step and data-parallel
    replica, which caps the in-flight count (``None``: no cap); ``fused_swiglu``: the experts'
    probability-weighted SwiGLU is one autograd node that keeps 3 ``F``-wide tensors per row (folding's,
    and Megatron-Core's; the default); ``False`` estimates a plain-autograd activation (5 per row).
    ``overlap_moe_comm`` (``parallel.overlap_moe_comm``): the chunk forwards its longer warm-up keeps in
    flight (:func:`~folding.planning.activations.in_flight_chunks`); on the last rank a pair also keeps
    the previous micro-batch's loss input, log-sum-exp and multi-token-prediction activations.
    ``optim_precision``: the optimizer's state and gradient dtypes (``None``: all fp32). ``offload``: the
    offload modules (``train.offload_modules``, names joined by commas): what they keep moves to
    :attr:`MemoryEstimate.host`, and the two layers' worth that backward brings back at a time (one in use,
    one prefetched) counts as transient.
    """
    prec = optim_precision or OptimizerPrecision()
    recompute = recompute_mode(recompute).name  # a mode, or modules (folding.model.recompute); raises naming it
    if stage is None:
        ests = [
            memory_per_rank(
                cfg,
                layout,
                param_bytes=param_bytes,
                distributed=distributed,
                recompute=recompute,
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                act_bytes=act_bytes,
                stage=k,
                num_microbatches=num_microbatches,
                fused_swiglu=fused_swiglu,
                overlap_moe_comm=overlap_moe_comm,
                optim_precision=prec,
                offload=offload,
            )
            for k in range(layout.pp)
        ]
        return max(ests, key=lambda e: e.total)
    if not 0 <= stage < layout.pp:
        raise ValueError(f"stage={stage} is not a pipeline stage of pp={layout.pp}")
    c = param_counts(cfg, layout, stage=stage)
    moments = prec.state_bytes(4)  # both moments (fp32 elements: no master copy)
    master = prec.master_bytes(param_bytes)  # fp32 master weights beside 16-bit parameters, if kept
    if prec.name == "muon":  # Muon's matrices keep one fp32 momentum; AdamW keeps the rest
        muon = MUON_MOMENTUM_BYTES
        opt_d = moments * c.adamw + muon * (c.dense - c.adamw) + master * (c.dense - c.fp32)
        opt_e = (muon + master) * c.expert
    else:
        opt_d = moments * c.dense + master * (c.dense - c.fp32)
        opt_e = (moments + master) * c.expert
    opt_d /= layout.dp * layout.cp if distributed else 1
    opt_e /= layout.edp if distributed else 1
    grad = prec.grad_bytes()
    acts = transient = host = 0
    if seq_length:
        acts, transient, host = _stage_activations(
            cfg,
            _StageSizes(layout.tp, layout.cp, layout.etp, layout.pp, layout.vpp or 1),
            _ends(layout),
            stage,
            (seq_length, micro_batch_size, recompute, act_bytes, fused_swiglu),
            num_microbatches,
            overlap_moe_comm,
            offload_set(offload),
        )
    if prec.name == "muon":
        transient += muon_transient_bytes(cfg, layout, distributed=distributed)
    return MemoryEstimate(
        params_dense=(c.dense - c.fp32) * param_bytes + 4 * c.fp32,
        params_expert=c.expert * param_bytes,
        grads_dense=grad * c.dense,
        grads_expert=grad * c.expert,
        optimizer_dense=int(opt_d),
        optimizer_expert=int(opt_e),
        activations=int(acts),
        stage=stage,
        transient=int(transient),
        host=int(host),
    )


class _StageSizes(NamedTuple):
    """The sizes of a layout that a stage's activations depend on (all :func:`_stage_activations` reads)."""

    tp: int
    """Attention tensor parallel."""
    cp: int
    """Context parallel."""
    etp: int
    """Expert tensor parallel."""
    pp: int
    """Pipeline parallel."""
    vpp: int
    """Virtual stages per pipeline rank."""


@functools.lru_cache(maxsize=65536)
def _stage_activations(
    cfg: ModelConfig,
    layout: _StageSizes,
    ends: Ends,
    stage: int,
    shape: tuple,
    num_microbatches: Optional[int],
    overlap_moe_comm: bool,
    off,
) -> Tuple[float, int, float]:
    """``(activations, transients, host)`` bytes of :func:`memory_per_rank` on ``stage``, cached: layouts that
    differ only in what the activations do not read (the optimizer's sharding, DP) share them. ``shape``:
    ``(seq_length, micro_batch_size, recompute, act_bytes, fused_swiglu)``; ``off``: the offload modules."""
    seq_length, micro_batch_size, recompute, act_bytes, fused_swiglu = shape
    kw = dict(
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        recompute=recompute,
        act_bytes=act_bytes,
        fused_swiglu=fused_swiglu,
    )
    vpp = layout.vpp
    n_layers, n_dense = _stage_counts(cfg, layout.pp, vpp, stage, ends)
    sizes, kw_key = _LayerSizes(layout.tp, layout.cp, layout.etp), tuple(kw.items())

    def per_layer(moe_layer: bool, what: str = "device", offload=()) -> int:
        return _layer_bytes(cfg, sizes, kw_key, what, moe_layer, offload)

    per_mb = per_layer(True, offload=off) * (n_layers - n_dense) + (
        per_layer(False, offload=off) * n_dense if n_dense else 0
    )
    # host: what the offload modules copy out, for every layer of every chunk forward in flight
    host_mb = (n_layers - n_dense) * per_layer(True, "host", offload=off) + n_dense * (
        per_layer(False, "host", offload=off) if n_dense else 0
    )
    flight = dict(pp=layout.pp, vpp=vpp, stage=stage, num_microbatches=num_microbatches)
    chunks = in_flight_chunks(**flight, overlap_moe_comm=overlap_moe_comm)
    rope = rope_bytes(cfg, layout, seq_length=seq_length, act_bytes=act_bytes)  # per chunk holding a layer
    acts = (per_mb + rope * _busy_chunks(cfg, layout.pp, vpp, stage, ends)) * chunks / vpp
    host = host_mb * chunks / vpp
    if stage == layout.pp - 1 and chunks > in_flight_chunks(**flight):
        # the pair's two micro-batches on the last virtual stage: the earlier one's loss input (the
        # final norm's output) and log-sum-exp, and its multi-token-prediction modules, stay alive too
        tokens = seq_length * micro_batch_size // layout.cp
        acts += act_bytes * tokens * cfg.hidden_size + 4 * tokens + per_layer(True, "mtp", offload=off)
    if stage == layout.pp - 1:
        acts += logits_bytes(cfg, layout, seq_length=seq_length, micro_batch_size=micro_batch_size, act_bytes=act_bytes)
        # the MTP modules run in the last virtual stage, whose backward follows each forward at once on
        # the last rank: one micro-batch of theirs is alive at the peak
        acts += per_layer(True, "mtp", offload=off)
    transient = per_layer(True, "transient")
    if off:  # backward brings back one layer while the next one's copy arrives
        moved = max(per_layer(m) - per_layer(m, offload=off) for m in (True, False))
        transient += 2 * moved
    return acts, transient, host


class _LayerSizes(NamedTuple):
    """The sizes of a layout that one layer's activations depend on (all :mod:`folding.planning.activations`
    reads), so that layouts alike in them share :func:`_layer_bytes`."""

    tp: int
    """Attention tensor parallel."""
    cp: int
    """Context parallel."""
    etp: int
    """Expert tensor parallel."""


@functools.lru_cache(maxsize=65536)
def _layer_bytes(cfg: ModelConfig, sizes: _LayerSizes, kw: tuple, what: str, moe_layer: bool, offload) -> int:
    """One layer's bytes for :func:`memory_per_rank`, cached (every stage of every candidate plan asks):
    ``what`` is ``device`` (:func:`~folding.planning.activations.activation_bytes_per_layer`), ``host``
    (:func:`~folding.planning.activations.offloaded_bytes_per_layer`), ``mtp``
    (:func:`~folding.planning.activations.mtp_activation_bytes`) or ``transient``
    (:func:`~folding.planning.activations.transient_bytes`); ``kw``: their shared keywords as items."""
    kw = dict(kw)
    if what == "host":
        return offloaded_bytes_per_layer(cfg, sizes, moe_layer=moe_layer, offload=offload, **kw)
    if what == "mtp":
        return mtp_activation_bytes(cfg, sizes, offload=offload, **kw)
    if what == "transient":
        return transient_bytes(cfg, sizes, **kw)
    return activation_bytes_per_layer(cfg, sizes, moe_layer=moe_layer, offload=offload, **kw)


class _OneRank:
    """The trivial layout (one rank holds every parameter) for whole-model counts."""

    tp = pp = vpp = ep = etp = cp = dp = edp = 1


def state_bytes_per_param(cfg: ModelConfig, prec: OptimizerPrecision, *, param_bytes: int) -> float:
    """Optimizer-state bytes per parameter element averaged over the whole model (unsharded): AdamW's
    :meth:`~OptimizerPrecision.state_bytes` for every element, or under ``prec.name == "muon"`` Muon's
    momentum (plus master) for the hidden matrices and AdamW's for :attr:`ParamCounts.adamw`."""
    if prec.name != "muon":
        return prec.state_bytes(param_bytes)
    c = param_counts(cfg, _OneRank(), stage=0)
    share = c.adamw / (c.dense + c.expert)
    return prec.muon_state_bytes(param_bytes) * (1 - share) + prec.state_bytes(param_bytes) * share


def adamw_share(cfg: ModelConfig) -> float:
    """Fraction of the model's parameters AdamW keeps under ``optim.name=muon`` (:attr:`ParamCounts.adamw`)."""
    c = param_counts(cfg, _OneRank(), stage=0)
    return c.adamw / (c.dense + c.expert)
