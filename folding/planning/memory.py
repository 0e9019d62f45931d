"""The analytic model of per-rank memory: parameters, gradients, optimizer state, activations.

One function of (model sizes, layout, optimizer settings, recompute mode), shared by the memory
tests, the training dry run, ``tools/memory.py`` and the planner. Parameter counts follow the
parameter layout of ``folding`` exactly (what each rank holds under TP/SP, EP, ETP and PP); gradient
and optimizer bytes follow :class:`folding.optim.FoldedOptimizer`; activations are an estimate.

Per rank (``P_d`` dense and ``P_e`` expert parameters held by the rank):

- parameters: ``(P_d + P_e) * param_bytes``, except the routers' gating weights, which stay fp32
  whatever the parameter dtype (4 bytes each);
- gradients: fp32 main grads, ``4 * (P_d + P_e)``;
- optimizer: AdamW moments ``8`` bytes per element, plus ``4`` for fp32 master weights of the
  parameters that are not fp32; with ``distributed`` (ZeRO-1) dense state is divided by ``DP*CP`` and
  expert state by ``EDP``. So expert parameters and gradients per rank scale as
  ``1/(EP*ETP*PP)``, and with ZeRO-1 the expert optimizer state as ``1/world`` (it does not shrink
  with EP at a fixed world size). Bucket padding (< one element per bucket per shard) is ignored.
- activations (estimate, bf16 by default, flash attention, sequence parallelism): per layer and
  micro-batch, with ``T = seq*mbs/(TP*CP)`` tokens per rank and ``R = T*top_k*ETP`` expert rows,
  see :mod:`folding.planning.activations`; times the layers of the stage and the chunk forwards in
  flight at the schedule's peak (1F1B: ``PP - stage`` micro-batches; interleaved: Megatron-Core's
  warm-up count, capped by the step's micro-batches); plus, on the last stage, the fused output
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

    sizes = ModelSizes.from_model_config(get_preset("mixtral_8x7b"))
    layout = ParallelLayout(world_size=64, tp=1, pp=4, ep=8, etp=1)
    est = memory_per_rank(sizes, layout, param_bytes=2, distributed=True, recompute="selective",
                          seq_length=4096, micro_batch_size=1, num_microbatches=16)
    est.total / 2**30
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, List, Optional, Sequence, Tuple

from folding.parallel.partition import layers_of, partition_layers

from .activations import (
    RECOMPUTE_MODES,
    activation_bytes_per_layer,
    in_flight_chunks,
    logits_bytes,
    mtp_activation_bytes,
    transient_bytes,
)

Ends = Tuple[Optional[int], Optional[int]]
"""``(first_stage_layers, last_stage_layers)`` of a layout, ``None`` where even."""

__all__ = [
    "RECOMPUTE_MODES",
    "ModelSizes",
    "ParamCounts",
    "MemoryEstimate",
    "activation_bytes_per_layer",
    "in_flight_chunks",
    "layers_on_stage",
    "logits_bytes",
    "memory_per_rank",
    "model_sizes",
    "mtp_activation_bytes",
    "mtp_layer_numbers",
    "mtp_module_params",
    "param_counts",
    "peak_candidate_stages",
    "stage_layers",
    "transient_bytes",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSizes:
    """The sizes that determine memory (a subset of a model config; see :meth:`from_config`)."""

    vocab_size: int
    """Vocabulary size (padded if the model pads it)."""
    hidden_size: int
    """Model width H."""
    num_layers: int
    """Transformer layers (all MoE layers unless ``dense_ffn_hidden_size`` adds a dense MLP)."""
    num_experts: int
    """Routed experts per MoE layer E."""
    moe_ffn_hidden_size: int
    """Hidden size of one routed expert's SwiGLU FFN (fc1 H→2F, fc2 F→H)."""
    top_k: int = 2
    """Experts per token."""
    num_attention_heads: int = 0
    """Query heads (0: no attention block, as in small test models)."""
    num_query_groups: Optional[int] = None
    """Key/value heads (GQA); ``None`` means ``num_attention_heads``."""
    head_dim: Optional[int] = None
    """Per-head dimension; ``None`` means ``hidden_size // num_attention_heads``."""
    qkv_bias: bool = False
    """Biases on Q, K, V (Qwen2)."""
    qk_norm: str = "none"
    """Q/K RMSNorm: ``none``; ``head`` (Qwen3-MoE: two ``head_dim`` weights, replicated); ``full``
    (OLMoE: weights of the q and k projection widths, TP-sharded)."""
    dense_layers: Tuple[int, ...] = ()
    """Indices of layers with a dense SwiGLU MLP of ``ffn_hidden_size`` instead of the MoE block (the
    multi-token-prediction layers are numbered ``num_layers .. num_layers + mtp_num_layers - 1``)."""
    ffn_hidden_size: int = 0
    """FFN width of the dense layers listed in ``dense_layers``."""
    dense_ffn_hidden_size: int = 0
    """A dense MLP in every MoE layer besides the MoE block (small test models; 0: none)."""
    dense_gated: bool = True
    """The dense MLP is SwiGLU (fc1 H→2F) rather than plain (H→F)."""
    dense_bias: bool = False
    """The dense MLP has biases (fc1: F, TP-sharded; fc2: H, sequence-parallel)."""
    shared_expert_ffn_hidden_size: int = 0
    """Shared-expert SwiGLU FFN size (Qwen2-MoE), TP-sharded; 0: none."""
    shared_expert_gate: bool = False
    """Sigmoid gate [1, H] on the shared expert."""
    tied_embeddings: bool = False
    """Input embedding and output layer share one weight."""
    norms_per_layer: int = 2
    """RMSNorm scales per layer (each H, sequence-parallel)."""
    kv_lora_rank: int = 0
    """Multi-head latent attention (DeepSeek-V3): width of the compressed KV latent; 0: GQA attention."""
    q_lora_rank: int = 0
    """MLA: width of the query latent; 0: a plain ``q_proj``."""
    qk_nope_head_dim: int = 0
    """MLA: position-free query/key dims per head."""
    qk_rope_head_dim: int = 0
    """MLA: rotary query/key dims per head (the rotary key is shared by the heads)."""
    v_head_dim: int = 0
    """MLA: value dims per head."""
    mtp_num_layers: int = 0
    """Multi-token-prediction modules D (DeepSeek-V3: 1), all on the last virtual stage of the last
    pipeline rank: each one transformer layer (MoE or dense by ``dense_layers``), two input RMSNorms, a
    ``2H -> H`` projection and an output RMSNorm (all replicated over TP), sharing the embedding and the
    output layer (the last stage holds its own embedding copy when the embedding is untied and PP > 1)."""

    @classmethod
    def from_model_config(cls, cfg) -> "ModelSizes":
        """The sizes of a :class:`folding.model.config.ModelConfig`."""
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers,
            num_experts=cfg.moe.num_experts,
            moe_ffn_hidden_size=cfg.moe.ffn_hidden_size,
            top_k=cfg.moe.topk,
            num_attention_heads=cfg.num_attention_heads,
            num_query_groups=cfg.num_kv_heads,
            head_dim=cfg.kv_channels,
            qkv_bias=cfg.qkv_bias,
            qk_norm=cfg.qk_norm,
            dense_layers=tuple(i for i in cfg.layer_numbers() if not cfg.is_moe_layer(i)),
            ffn_hidden_size=cfg.ffn_hidden_size,
            shared_expert_ffn_hidden_size=cfg.moe.shared_expert_ffn_hidden_size or 0,
            shared_expert_gate=cfg.moe.shared_expert_gate,
            tied_embeddings=cfg.tie_embeddings,
            mtp_num_layers=cfg.mtp_num_layers,
            **_mla_sizes(cfg),
        )


def _mla_sizes(cfg) -> Dict[str, int]:
    m = getattr(cfg, "mla", None)
    if m is None:
        return {}
    return dict(
        kv_lora_rank=m.kv_lora_rank,
        q_lora_rank=m.q_lora_rank or 0,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
    )


def mla_param_counts(s: ModelSizes, tp: int) -> Tuple[int, int]:
    """``(replicated, TP-sharded)`` parameter elements of one MLA block on a rank: the down-projections
    and latent norms are replicated over TP; ``q_b_proj`` (or ``q_proj``), ``kv_b_proj`` and ``o_proj``
    hold ``N/TP`` heads."""
    h, n = s.hidden_size, s.num_attention_heads
    dqk = s.qk_nope_head_dim + s.qk_rope_head_dim
    rep = h * (s.kv_lora_rank + s.qk_rope_head_dim) + s.kv_lora_rank
    q_in = h
    if s.q_lora_rank:
        rep += h * s.q_lora_rank + s.q_lora_rank
        q_in = s.q_lora_rank
    heads = _div(n, tp, "num_attention_heads")
    sharded = heads * (q_in * dqk + s.kv_lora_rank * (s.qk_nope_head_dim + s.v_head_dim) + s.v_head_dim * h)
    return rep, sharded


@functools.lru_cache(maxsize=64)
def model_sizes(cfg) -> ModelSizes:
    """:meth:`ModelSizes.from_model_config`, cached per (hashable, frozen) model config."""
    return ModelSizes.from_model_config(cfg)


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
    ``seq_length`` is 0)."""

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


def _div(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by {d}; choose sizes that divide evenly")
    return n // d


def stage_layers(
    sizes: ModelSizes, layout, stage: int, stages: Optional[Sequence[Tuple[int, int]]] = None
) -> List[int]:
    """Decoder layer indices held by pipeline rank ``stage`` (all its virtual chunks; the
    multi-token-prediction layers, :func:`mtp_layer_numbers`, come on top on the last rank). ``stages``: the
    ``[start, end)`` of every virtual stage (default: :func:`folding.parallel.partition.partition_layers`)."""
    if stages is None:
        return list(_default_stage_layers(sizes.num_layers, layout.pp, layout.vpp or 1, stage, _ends(layout)))
    out: List[int] = []
    for chunk in range(len(stages) // layout.pp):
        out.extend(layers_of(rank=stage, chunk=chunk, pp=layout.pp, stages=list(stages)))
    return out


@functools.lru_cache(maxsize=65536)
def _default_stage_layers(num_layers: int, pp: int, vpp: int, stage: int, ends: Ends = (None, None)) -> Tuple[int, ...]:
    stages = partition_layers(
        num_layers=num_layers,
        pp=pp,
        vpp=vpp if vpp > 1 else None,
        first_stage_layers=ends[0],
        last_stage_layers=ends[1],
    )
    out: List[int] = []
    for chunk in range(len(stages) // pp):
        out.extend(layers_of(rank=stage, chunk=chunk, pp=pp, stages=stages))
    return tuple(out)


def peak_candidate_stages(sizes: ModelSizes, layout) -> List[int]:
    """The pipeline ranks one of which holds the most memory: the first, the last, and, among the others,
    the first rank of each distinct mix of (layers, dense layers) under the default partition (a later rank
    with the same mix holds the same parameters and fewer micro-batches in flight). With dense layers only
    at the start (DeepSeek-V3) a middle rank can hold more experts than the first."""
    vpp, ends = layout.vpp or 1, _ends(layout)
    out, seen = [0], set()
    for k in range(1, layout.pp - 1):
        mix = _stage_counts(sizes, layout.pp, vpp, k, ends)
        if mix not in seen and mix != _stage_counts(sizes, layout.pp, vpp, 0, ends):
            seen.add(mix)
            out.append(k)
    return sorted(set(out) | {layout.pp - 1})


def layers_on_stage(sizes: ModelSizes, layout, stage: int) -> int:
    """Number of layers on pipeline rank ``stage`` (default partition)."""
    return len(stage_layers(sizes, layout, stage))


def param_counts(
    sizes: ModelSizes, layout, *, stage: int = 0, stages: Optional[Sequence[Tuple[int, int]]] = None
) -> ParamCounts:
    """Parameter elements on one rank of pipeline ``stage`` under ``layout`` (a ParallelLayout);
    ``stages`` as in :func:`stage_layers`."""
    if stages is None:
        return _param_counts(sizes, layout.tp, layout.pp, layout.vpp or 1, layout.ep, layout.etp, stage, _ends(layout))
    return _param_counts_of(
        sizes, layout.tp, layout.pp, layout.ep, layout.etp, stage, stage_layers(sizes, layout, stage, stages)
    )


def _ends(layout) -> Ends:
    """The layout's ``(first_stage_layers, last_stage_layers)`` (planner plans and layouts; ``None``
    where it has none)."""
    return getattr(layout, "first_stage_layers", None), getattr(layout, "last_stage_layers", None)


def _stage_counts(sizes: ModelSizes, pp: int, vpp: int, stage: int, ends: Ends = (None, None)) -> Tuple[int, int]:
    """(layers, dense layers) on pipeline rank ``stage`` under the default partition, cached."""
    return _stage_counts_cached(sizes, pp, vpp, stage, ends)


@functools.lru_cache(maxsize=65536)
def _stage_counts_cached(sizes: ModelSizes, pp: int, vpp: int, stage: int, ends: Ends) -> Tuple[int, int]:
    mine = _default_stage_layers(sizes.num_layers, pp, vpp, stage, ends)
    return len(mine), sum(1 for i in mine if i in sizes.dense_layers)


@functools.lru_cache(maxsize=65536)
def _param_counts(
    sizes: ModelSizes, tp: int, pp: int, vpp: int, ep: int, etp: int, stage: int, ends: Ends = (None, None)
) -> ParamCounts:
    return _param_counts_of(
        sizes, tp, pp, ep, etp, stage, _default_stage_layers(sizes.num_layers, pp, vpp, stage, ends)
    )


def _param_counts_of(
    sizes: ModelSizes, tp: int, pp: int, ep: int, etp: int, stage: int, mine: Sequence[int]
) -> ParamCounts:
    s = sizes
    h = s.hidden_size
    layer = s.norms_per_layer * h  # norms (replicated)
    if s.num_attention_heads and s.kv_lora_rank:
        layer += sum(mla_param_counts(s, tp))
    elif s.num_attention_heads:
        nq = s.num_attention_heads
        nkv = s.num_query_groups or nq
        hd = s.head_dim or h // nq
        qkv = (nq + 2 * nkv) * hd
        layer += _div(qkv * h + (qkv if s.qkv_bias else 0) + nq * hd * h, tp, "attention size")
        if s.qk_norm == "head":
            layer += 2 * hd
        elif s.qk_norm == "full":
            layer += _div((nq + nkv) * hd, tp, "q/k norm size")
    if s.dense_ffn_hidden_size:
        f = s.dense_ffn_hidden_size
        layer += _div(h * f * (3 if s.dense_gated else 2), tp, "dense_ffn_hidden_size*H")
        if s.dense_bias:
            layer += _div(f * (2 if s.dense_gated else 1), tp, "dense_ffn_hidden_size") + h
    moe = s.num_experts * h  # router (replicated)
    if s.shared_expert_ffn_hidden_size:
        moe += _div(3 * h * s.shared_expert_ffn_hidden_size, tp, "shared_expert_ffn_hidden_size*H")
        moe += h if s.shared_expert_gate else 0
    experts = _div(s.num_experts, ep, "num_experts") * _div(
        3 * h * s.moe_ffn_hidden_size, etp, "3*H*moe_ffn_hidden_size"
    )
    first, last = stage == 0, stage == pp - 1
    if last:  # the multi-token-prediction layers run on the last virtual stage, after the decoder's
        mine = [*mine, *mtp_layer_numbers(s)]
    n_dense = sum(1 for i in mine if i in s.dense_layers)
    n_moe = len(mine) - n_dense
    dense = len(mine) * layer + n_moe * moe
    if n_dense:
        dense += n_dense * _div(3 * h * s.ffn_hidden_size, tp, "ffn_hidden_size*H")
    emb = _div(s.vocab_size, tp, "vocab_size") * h
    if first:
        dense += emb
    if last:
        dense += h  # final norm
        if not s.tied_embeddings or not first:
            dense += emb  # output layer (or tied copy)
        if s.mtp_num_layers:
            dense += s.mtp_num_layers * mtp_module_params(s)
            if not s.tied_embeddings and not first:
                dense += emb  # the last stage's own copy of the (untied) embedding, for the MTP inputs
    return ParamCounts(dense=dense, expert=n_moe * experts, fp32=n_moe * s.num_experts * h)


def mtp_layer_numbers(sizes: ModelSizes) -> range:
    """Layer numbers of the multi-token-prediction modules' transformer layers (after the decoder's)."""
    return range(sizes.num_layers, sizes.num_layers + sizes.mtp_num_layers)


def mtp_module_params(sizes: ModelSizes) -> int:
    """Parameter elements of one multi-token-prediction module besides its transformer layer, on every TP
    rank (replicated): the embedding and hidden input norms, the ``[H, 2H]`` projection, the output norm."""
    h = sizes.hidden_size
    return 2 * h * h + 3 * h


def memory_per_rank(
    sizes: ModelSizes,
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
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r} must be one of {', '.join(RECOMPUTE_MODES)} (train.recompute)")
    if stage is None:
        ests = [
            memory_per_rank(
                sizes,
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
            )
            for k in range(layout.pp)
        ]
        return max(ests, key=lambda e: e.total)
    if not 0 <= stage < layout.pp:
        raise ValueError(f"stage={stage} is not a pipeline stage of pp={layout.pp}")
    c = param_counts(sizes, layout, stage=stage)
    master = 4 if param_bytes != 4 else 0  # fp32 master weights beside 16-bit parameters
    opt_d = (8 * c.dense + master * (c.dense - c.fp32)) / (layout.dp * layout.cp if distributed else 1)
    opt_e = (8 + master) * c.expert / (layout.edp if distributed else 1)
    acts = transient = 0
    if seq_length:
        kw = dict(
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            recompute=recompute,
            act_bytes=act_bytes,
            fused_swiglu=fused_swiglu,
        )
        vpp = layout.vpp or 1
        n_layers, n_dense = _stage_counts(sizes, layout.pp, vpp, stage, _ends(layout))
        per_mb = activation_bytes_per_layer(sizes, layout, moe_layer=True, **kw) * (n_layers - n_dense) + (
            activation_bytes_per_layer(sizes, layout, moe_layer=False, **kw) * n_dense if n_dense else 0
        )
        chunks = in_flight_chunks(pp=layout.pp, vpp=vpp, stage=stage, num_microbatches=num_microbatches)
        acts = per_mb * chunks / vpp
        if stage == layout.pp - 1:
            acts += logits_bytes(
                sizes, layout, seq_length=seq_length, micro_batch_size=micro_batch_size, act_bytes=act_bytes
            )
            # the MTP modules run in the last virtual stage, whose backward follows each forward at once on
            # the last rank: one micro-batch of theirs is alive at the peak
            acts += mtp_activation_bytes(sizes, layout, **kw)
        transient = transient_bytes(sizes, layout, **kw)
    return MemoryEstimate(
        params_dense=(c.dense - c.fp32) * param_bytes + 4 * c.fp32,
        params_expert=c.expert * param_bytes,
        grads_dense=4 * c.dense,
        grads_expert=4 * c.expert,
        optimizer_dense=int(opt_d),
        optimizer_expert=int(opt_e),
        activations=int(acts),
        stage=stage,
        transient=int(transient),
    )
