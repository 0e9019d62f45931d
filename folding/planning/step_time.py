"""Analytic step time of one folded layout: compute, communication on the links it crosses, pipeline bubble.

The model follows one global batch through the bottleneck pipeline stage: the slowest of the last stage (its
layers, the output layer and cross-entropy, and any multi-token-prediction modules: each one more
transformer layer, a ``2H -> H`` projection and another output layer + cross-entropy), the first stage and the
stages between them (``L/PP`` layers each, or the split of ``Plan.first_stage_layers`` /
``Plan.last_stage_layers``, or the layers each pipeline rank's virtual stages hold under
``Plan.pipeline_layout``, zero-layer stages included: :func:`folding.parallel.partition.partition_layers`;
ranks between with the same layer count are one kind). Per micro-batch and transformer layer, on one GPU:

- **Compute**: matmul FLOPs of :mod:`folding.planning.flops` for the rank's share (tokens split over
  TP·CP for attention; the expert work of a stage is balanced over its ranks, so each GPU does
  ``tokens/(TP·CP)`` worth whatever EP/ETP), forward, dgrad and wgrad GEMMs (+ the recomputed
  sublayers), each at ``compute_efficiency × peak`` in waves of output tiles or at its HBM time if longer
  (wgrad accumulates into fp32 main gradients). ``compute_efficiency`` is the one calibrated constant.
- **Memory-bound kernels**: bytes moved by norms, residuals, RoPE, permute/unpermute, the dispatcher's
  expert-major sort and its inverse, and SwiGLU, at the achievable HBM bandwidth.
- **TP** (sequence parallel), per TP block (QKV + projection; a shared expert / dense MLP): forward all-gather
  and reduce-scatter and the backward all-gather of the output gradient exposed; the backward re-gather of
  the input and reduce-scatter of its gradient overlapped with the column-parallel GEMM's dgrad / wgrad
  (Megatron-Core's default, and folding's :mod:`folding.parallel.sequence_parallel`); with
  ``Cluster.tp_comm_overlap`` all of them chunked behind the block's GEMMs.
- **CP** (folding's, :mod:`folding.model.context_parallel`): an all-gather of K and one of V per attention
  forward, a reduce-scatter of dK and one of dV per backward, all exposed (the attention core waits for
  them), plus the memory-bound sort of the gathered K/V into sequence order and its backward.
- **EP / ETP** (MoE layers): all-to-all dispatch + combine forward and backward, each sending
  ``(EP-1)/EP`` of the rank's ``tokens·k`` routed copies; with ETP>1 an all-gather / reduce-scatter over
  ETP of ``(ETP-1)`` times those copies. The all-to-all crosses nodes when the dispatch group
  (ETP·EP consecutive ranks folded; TP·CP·EP without folding) outgrows the NVLink domain: the share of
  peers on other nodes goes over the NIC, the rest over NVLink, at the same time. With
  ``Plan.overlap_moe_comm`` each exchange of the paired steady state hides behind the other micro-batch's
  matching compute, bounded by it (:mod:`folding.planning.moe_overlap`); the unpaired warm-up / cool-down
  share and the bubble keep them exposed.
- **PP**: activation send/recv per micro-batch and virtual stage, waited for under 1F1B, overlapped with a
  chunk's compute under interleaving (Megatron-Core's ``overlap_p2p_comm``); **bubble** ``(PP-1)/VPP``
  stage times.
- **DP**: dense gradients over DP·CP and expert gradients over EDP, reduce-scatter (distributed
  optimizer) or all-reduce in the main gradients' dtype (fp32, or bf16: ``TrainingShape.optim_precision``),
  queued on the GPU's links per model chunk and overlapped with the backward
  that follows each chunk's last micro-batch (:func:`_exposed_behind_chunks`; the hidden part still costs
  ``overlap_contention`` of its time); the distributed optimizer's bf16 parameter all-gather, hidden only
  behind the optimizer step itself (memory-bound: the update's bytes per element from
  :meth:`~folding.planning.optim_precision.OptimizerPrecision.update_traffic_bytes`), as folding waits
  for it at the end of the step.

Every collective also pays a fixed latency (see :mod:`folding.planning.hardware`).

Routing is balanced unless ``moe_load`` gives the slowest EP rank's load (:mod:`folding.planning.imbalance`):
then every MoE layer's expert GEMMs and received-row passes scale with its rows, its exchanges with its
received copies.

Usage::

    t = estimate_step_time(cfg, plan, shape=TrainingShape(seq_length=4096, global_batch_size=256),
                           cluster=Cluster(gpu=get_gpu("h100"), num_gpus=128), compute_efficiency=0.6)
    t.step_s, t.mfu, t.breakdown
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Dict, List, Optional, Tuple

from folding.model.config import ModelConfig, recompute_mode
from folding.parallel.partition import partition_layers

from . import activations as A
from . import flops as F
from .costs import (
    _a2a_time,
    _exposed_behind_chunks,
    _ring_time,
    _staged_a2a_time,
    gemm_time_parts,
    gemm_train_times,
    hidden_behind,
)
from .hardware import GPUSpec
from .memory import _stage_counts, param_counts
from .moe_overlap import MoEPieces, exposed_exchanges, paired_share
from .node_dispatch import exchange_rows
from .optim_precision import OptimizerPrecision, muon_flops

BF16, FP32 = 2, 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingShape:
    """What one optimizer step processes."""

    seq_length: int
    """Tokens per sample."""
    global_batch_size: int
    """Samples per optimizer step."""
    micro_batch_size: int = 1
    """Samples per micro-batch (per data-parallel replica)."""
    fused_swiglu: bool = True
    """The experts' probability-weighted SwiGLU is one autograd node (folding's and Megatron-Core's), keeping
    3 ``F``-wide tensors per routed row for backward; ``False`` plans for a plain-autograd activation that
    keeps 5 (memory only)."""
    optim_precision: OptimizerPrecision = OptimizerPrecision()
    """The optimizer's state and gradient dtypes (``optim.exp_avg_dtype`` ...): optimizer and gradient
    memory, the gradient reduction's bytes and the update's memory traffic."""
    fp8_recipe: Optional[str] = None
    """``moe.fp8_recipe``: the routed experts' GEMMs (forward, dgrad, wgrad) run in FP8 at the GPU's FP8 peak
    and its own efficiency (:attr:`~folding.planning.hardware.GPUSpec.fp8_efficiency`, one constant for every
    recipe); ``None``: bf16. The plan's memory reads it too, as the job's ``moe.fp8_recipe``: the experts keep
    their GEMM inputs in FP8 (:func:`folding.planning.planner.plan_memory`)."""
    fp8_dense: bool = False
    """With ``fp8_recipe``: the dense linear layers (attention projections, shared expert, dense MLP) run in
    FP8 too, as Megatron-Core's ``--fp8-format`` does for every TransformerEngine linear (folding's dense
    precision is bf16: plan this for a Megatron-Core comparison). The attention core, router and output
    layer stay bf16."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """The GPUs a job runs on."""

    gpu: GPUSpec
    """GPU kind."""
    num_gpus: int
    """World size."""
    nvlink_domain: int = 8
    """GPUs per NVLink domain (per node on HGX); consecutive ranks fill a domain first."""
    tp_comm_overlap: bool = False
    """Sequence-parallel collectives chunked behind the block's GEMMs (TransformerEngine userbuffers,
    Megatron-Core's ``--tp-comm-overlap``, off by default there). ``False`` (the default, and folding's):
    forward all-gather / reduce-scatter and the backward all-gather of the output gradient are exposed; the
    backward re-gather of the input and reduce-scatter of its gradient overlap the dgrad / wgrad GEMMs."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """One candidate: a folded layout plus the knobs that change time and memory but not the math."""

    tp: int
    """Attention tensor parallel (sequence parallel when > 1)."""
    cp: int
    """Context parallel."""
    pp: int
    """Pipeline parallel."""
    vpp: int
    """Virtual stages per pipeline rank (1 = plain 1F1B)."""
    ep: int
    """Expert parallel."""
    etp: int
    """Expert tensor parallel."""
    dp: int
    """Attention data parallel, ``world/(tp·cp·pp)``."""
    edp: int
    """Expert data parallel, ``world/(etp·ep·pp)``."""
    distributed_optimizer: bool
    """Shard optimizer state over DP·CP (dense) and EDP (experts)."""
    recompute: str
    """Activation recomputation, a setting of :mod:`folding.model.recompute`: a mode of ``train.recompute``
    (``none``, ``selective`` = ``core_attn``, ``moe``, ``full``) or recompute modules joined by commas
    (``train.recompute_modules``), each charged the forwards it runs again."""
    last_stage_layers: Optional[int] = None
    """Layers of the last pipeline stage when ``pp`` does not divide the layers (the stages between
    share the rest evenly, ``parallel.last_stage_layers``); ``None``: as many as the stages between."""
    first_stage_layers: Optional[int] = None
    """Layers of the first pipeline stage, likewise (``parallel.first_stage_layers``); ``None``: as many
    as the stages between."""
    pipeline_layout: Optional[str] = None
    """``parallel.pipeline_layout``: what every virtual stage holds, in Megatron-Core's layout syntax
    (``vpp`` is then its stage count over ``pp``); ``None``: the split above."""
    folded: bool = True
    """``False`` models Megatron-Core without folding: ETP = TP and EP carved out of DP, so the dispatch
    group spans TP·CP·EP consecutive ranks instead of ETP·EP."""
    overlap_moe_comm: bool = False
    """``parallel.overlap_moe_comm``: the steady state pairs one micro-batch's forward with another's
    backward, each MoE exchange hidden behind the other's matching compute, at the cost of one more
    micro-batch of one chunk in flight (:mod:`folding.planning.moe_overlap`)."""
    delay_wgrad: bool = False
    """``parallel.delay_wgrad`` (with ``overlap_moe_comm``): the experts' weight-gradient GEMMs run behind
    the backward dispatch instead of behind the forward one."""
    offload: str = ""
    """``train.offload_modules`` joined by commas: what they keep goes to host memory in forward and comes
    back in backward over the host link, whatever part of it the layer's compute cannot hide is charged."""
    dispatcher: str = "alltoall"
    """``moe.dispatcher``: ``alltoall`` sends every routed copy on its own; ``hierarchical`` sends a token
    over the NIC once per distinct remote node and forwards it over NVLink there
    (:mod:`folding.planning.node_dispatch`)."""


CAUSES = ("compute", "memory_bound", "tp", "cp", "ep", "offload")
"""What a layer's time per micro-batch is made of (the per-stage breakdown's entries before the pipeline's)."""


@functools.lru_cache(maxsize=64)
def num_moe_layers(cfg: ModelConfig) -> int:
    """``cfg.num_moe_layers()``, cached (the planner asks for it for every candidate)."""
    return cfg.num_moe_layers()


@functools.lru_cache(maxsize=64)
def _model_flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    return F.flops_per_token(cfg, seq_length).model_training


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Predicted time of one optimizer step and where it goes."""

    step_s: float
    """Seconds per optimizer step."""
    mfu: float
    """Model FLOPs utilization (fraction of the cluster's peak BF16 FLOP/s)."""
    breakdown: Dict[str, float]
    """Seconds per step on the bottleneck stage by cause (compute, tp, cp, ep, pp, memory_bound, bubble,
    dp, optimizer)."""


def _tp_block(comm_s: float, fwd: int, tp: int, col: tuple, row: tuple, overlap: bool, contention: float) -> float:
    """Exposed seconds of the sequence-parallel collectives of one TP block (a column-parallel GEMM then a
    row-parallel one: QKV + projection, or fc1 + fc2), ``fwd`` forwards and one backward, each collective
    ``comm_s``. ``col`` / ``row``: ``(forward, dgrad, wgrad)`` seconds of the two GEMMs.

    Forward: all-gather of the input, reduce-scatter of the output. Backward: all-gather of the output
    gradient (the row-parallel GEMM needs it before its dgrad and wgrad: exposed), the re-gather of the
    column-parallel GEMM's input (its wgrad needs it; overlapped with that GEMM's dgrad) and the
    reduce-scatter of its input gradient (overlapped with its wgrad): Megatron-Core's and TransformerEngine's
    default. ``overlap`` models ``tp_comm_overlap`` (userbuffers): every collective is chunked behind the
    block's GEMMs, one chunk of ``tp`` exposed.
    """
    if overlap:
        comm = (2 * fwd + 3) * comm_s
        gemms = fwd * (col[0] + row[0]) + col[1] + col[2] + row[1] + row[2]
        hidden = min(comm * (1 - 1 / tp), gemms)
        return comm - hidden + contention * hidden
    return (
        (2 * fwd + 1) * comm_s + hidden_behind(comm_s, col[1], contention) + hidden_behind(comm_s, col[2], contention)
    )


def _mla_times(
    cfg: ModelConfig, plan: Plan, seq_tok: float, full_tok: float, lin, train, attn_fwd: int, up_fwd: int = 1
):
    """Multi-head latent attention GEMMs of one layer and micro-batch: ``(col, row, seconds, tp_width,
    forward_seconds)``. ``lin(m, n, k)``: ``(forward, dgrad, wgrad)`` seconds of a dense linear layer.

    The down-projections run replicated on the rank's sequence shard (``seq_tok / TP`` tokens); the
    query up-projection and the output projection on the CP chunk (``seq_tok``); the KV up-projection on
    the whole sequence (``full_tok``: each CP rank expands the gathered compressed KV). ``col`` / ``row``
    stand for the TP block's column- and row-parallel GEMMs in :func:`_tp_block`; ``tp_width`` is the
    average width of its two sequence-parallel collectives (the latents gathered, the hidden state
    reduce-scattered); ``forward_seconds``: the four GEMMs' forward once; ``wgrad_seconds``: their
    weight gradients. ``attn_fwd`` / ``up_fwd``: forwards of the down- and output projections / of the
    up-projections per training pass (2 where recomputed)."""
    m, H, N = cfg.mla, cfg.hidden_size, cfg.num_attention_heads
    heads = N / plan.tp
    q_in = m.q_lora_rank or H
    down = lin(seq_tok / plan.tp, (m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim, H)
    q_up = lin(seq_tok, heads * m.qk_head_dim, q_in)
    kv_up = lin(full_tok, heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    proj = lin(seq_tok, H, heads * m.v_head_dim)
    seconds = train(down, attn_fwd) + train(q_up, up_fwd) + train(kv_up, up_fwd) + train(proj, attn_fwd)
    latents = (m.q_lora_rank or H) + m.kv_lora_rank + m.qk_rope_head_dim
    fwd = down[0] + q_up[0] + kv_up[0] + proj[0]
    wgrad = down[2] + q_up[2] + kv_up[2] + proj[2]
    return q_up, proj, seconds, (latents + H) / 2, fwd, wgrad


def _loaded_train_times(
    rows: float, n: float, k: float, gpu: GPUSpec, eff: float, groups: int, load: float, dtype: str = "bf16"
):
    """``(forward, dgrad, wgrad)`` seconds of a grouped expert GEMM whose ``groups`` experts hold ``load``
    times their balanced ``rows`` in all: the tensor-core time of the balanced GEMM (its wave utilization:
    the experts' rows differ, so no one tile count stands for them) times ``load``, against the HBM time
    of the loaded rows. ``load = 1`` gives :func:`~folding.planning.costs.gemm_train_times` exactly."""
    if rows <= 0:
        return (0.0, 0.0, 0.0)
    out = []
    for (m_, n_, k_, ob), scaled in (((rows, n, k, 2.0), 0), ((rows, k, n, 2.0), 0), ((k, n, rows, 8.0), 2)):
        flops_t, _ = gemm_time_parts(m_, n_, k_, gpu, eff, groups, ob, dtype)
        dims = [m_, n_, k_]
        dims[scaled] *= load
        out.append(max(flops_t * load, gemm_time_parts(*dims, gpu, eff, groups, ob, dtype)[1]))
    return tuple(out)


LAYER_FIELDS = (
    "tp",
    "cp",
    "ep",
    "etp",
    "recompute",
    "folded",
    "overlap_moe_comm",
    "delay_wgrad",
    "offload",
    "dispatcher",
)
"""The :class:`Plan` fields a layer's time depends on (not the pipeline's cut, DP or the optimizer's sharding):
the planner's candidates share each layer time among all the plans alike in these."""


def _layer_times(
    cfg: ModelConfig,
    plan: Plan,
    shape: TrainingShape,
    cluster: Cluster,
    eff: float,
    moe: bool,
    moe_load: Optional[Tuple[float, float]] = None,
) -> Dict[str, float]:
    """Seconds of one transformer layer for one micro-batch (forward + backward) on one GPU, by cause.

    ``moe_load``: ``(compute, comm)``, the slowest EP rank's expert rows and received copies relative to
    the balanced ones (:class:`folding.planning.imbalance.RankLoads`); ``None``: balanced. Computed once per
    distinct :data:`LAYER_FIELDS` of ``plan`` (a fresh dict each call: callers may change it)."""
    key = tuple(getattr(plan, f) for f in LAYER_FIELDS)
    return dict(_layer_times_of(cfg, key, shape, cluster, eff, moe, moe_load))


@functools.lru_cache(maxsize=16384)
def _layer_times_of(cfg, key: tuple, shape, cluster, eff, moe, moe_load) -> Dict[str, float]:
    """:func:`_layer_times` of the plans whose :data:`LAYER_FIELDS` are ``key`` (the other fields held at one
    stage of one rank, which the layer's time does not read)."""
    plan = Plan(pp=1, vpp=1, dp=1, edp=1, distributed_optimizer=False, **dict(zip(LAYER_FIELDS, key)))
    return _layer_times_uncached(cfg, plan, shape, cluster, eff, moe, moe_load)


def _layer_times_uncached(cfg, plan, shape, cluster, eff, moe, moe_load) -> Dict[str, float]:
    load_c, load_a = moe_load if moe_load is not None else (1.0, 1.0)
    gpu, S, b = cluster.gpu, shape.seq_length, shape.micro_batch_size
    tok = S * b / (plan.tp * plan.cp)  # tokens this rank owns (sequence parallel)
    flops_rate = eff * gpu.bf16_flops
    # Forwards executed per training pass, per part: twice where the recompute setting recomputes it
    rc = recompute_mode(plan.recompute)  # the one table: folding.model.recompute
    whole = rc.whole_layer
    attn_fwd = 2 if whole else 1  # the attention projections
    core_fwd = 2 if whole or rc.has("core_attn") else 1
    up_fwd = 2 if whole or rc.has("mla_up_proj") else attn_fwd  # MLA's up-projections
    mlp_fwd = 2 if whole or rc.mlp(moe_layer=moe) else 1
    shared_n = 2 if mlp_fwd == 2 or (moe and rc.has("shared_experts")) else 1  # a TP-sharded MLP block
    act_fwd = 2 if mlp_fwd == 2 or rc.has("moe_act") else 1  # the experts' SwiGLU pass
    norm_fwd = 2 if whole or rc.has("layernorm") else 1

    def train(times, fwd):  # (forward, dgrad, wgrad) -> seconds for `fwd` forwards and one backward
        return fwd * times[0] + times[1] + times[2]

    # GEMM precision: the routed experts' under moe.fp8_recipe, the dense linears' too with fp8_dense
    x_eff, x_dt = (gpu.fp8_efficiency, "fp8") if shape.fp8_recipe else (eff, "bf16")
    d_eff, d_dt = (x_eff, x_dt) if shape.fp8_dense else (eff, "bf16")

    def lin(m_, n_, k_):  # a dense linear layer's (forward, dgrad, wgrad)
        return gemm_train_times(m_, n_, k_, gpu, d_eff, dtype=d_dt)

    core = F.attention_core_flops(cfg, S) * tok
    seq_tok = S * b / plan.cp  # tokens of the full (TP-gathered) CP chunk
    H, d = cfg.hidden_size, cfg.kv_channels
    if cfg.mla is None:
        qkv_n = (cfg.num_attention_heads + 2 * cfg.num_kv_heads) * d
        qkv = lin(seq_tok, qkv_n / plan.tp, H)
        proj = lin(seq_tok, H, cfg.num_attention_heads * d / plan.tp)
        attn_t = train(qkv, attn_fwd) + train(proj, attn_fwd)
        tp_width = H  # the sequence-parallel all-gather moves the hidden state
        attn_fwd_s = qkv[0] + proj[0]
        attn_wgrad = qkv[2] + proj[2]
    else:
        qkv, proj, attn_t, tp_width, attn_fwd_s, attn_wgrad = _mla_times(
            cfg, plan, seq_tok, S * b, lin, train, attn_fwd, up_fwd
        )
    tp_block = None  # (fc1, fc2) of a TP-sharded MLP (shared expert / dense)
    if moe:
        local = cfg.moe.num_experts // plan.ep
        rows = plan.etp * tok * cfg.moe.topk / local  # routed copies per local expert (balanced)
        f = cfg.moe.ffn_hidden_size / plan.etp
        # One grouped GEMM over the local experts for fc1 and one for fc2 (their tiles share the waves).
        if moe_load is None:
            fc1 = gemm_train_times(rows, 2 * f, H, gpu, x_eff, local, x_dt)
            fc2 = gemm_train_times(rows, H, f, gpu, x_eff, local, x_dt)
        else:  # the slowest rank's experts: load_c times the rows
            fc1 = _loaded_train_times(rows, 2 * f, H, gpu, x_eff, local, load_c, x_dt)
            fc2 = _loaded_train_times(rows, H, f, gpu, x_eff, local, load_c, x_dt)
        mlp_t = train(fc1, mlp_fwd) + train(fc2, mlp_fwd)
        router_t = F.router_flops(cfg) * tok / flops_rate
        mlp_t += (2 + mlp_fwd) * router_t
        if cfg.moe.shared_expert_ffn_hidden_size:
            fs = cfg.moe.shared_expert_ffn_hidden_size / plan.tp
            tp_block = (lin(seq_tok, 2 * fs, H), lin(seq_tok, H, fs))
    else:
        fd = cfg.ffn_hidden_size / plan.tp
        tp_block = (lin(seq_tok, 2 * fd, H), lin(seq_tok, H, fd))
        mlp_t = 0.0
    if tp_block is not None:
        mlp_t += train(tp_block[0], shared_n) + train(tp_block[1], shared_n)
    core_t = core / flops_rate
    # The dispatcher's host sync on split sizes: once per MoE forward.
    sync = mlp_fwd * gpu.host_sync_s if moe else 0.0
    out = {"compute": (2 + core_fwd) * core_t + attn_t + mlp_t + sync}

    # Memory-bound element-wise traffic (bytes per forward; backward ≈ 2x): norm, RoPE and residual on each
    # side. MoE: the permute (index_select) and unpermute (index_add) of the k·T routed copies, each a read
    # and a write of an H-row; the sort of the received R = ETP·k·T rows into expert-major order and its
    # inverse before the combine (only when there is something to sort: several local experts or ETP > 1);
    # the SwiGLU (3 F-rows per routed copy).
    elem_attn = 5 * H * BF16 * tok
    elem_mlp = 5 * H * BF16 * tok
    if moe:
        routed = cfg.moe.topk * tok
        sort = 4 * plan.etp * routed * H if (cfg.moe.num_experts // plan.ep > 1 or plan.etp > 1) else 0
        recv = 3 * routed * cfg.moe.ffn_hidden_size
        if moe_load is not None:  # the received rows of the slowest rank
            sort, recv = sort * load_c, recv * load_c
        elem_mlp += (4 * routed * H + sort + recv) * BF16
        elem_mlp += (act_fwd - mlp_fwd) * recv * BF16  # moe_act: the SwiGLU once more
    # layernorm: each norm's forward once more (a read and a write of an H-row per token and norm)
    elem_norm = (norm_fwd - (2 if whole else 1)) * 2 * 2 * H * BF16 * tok
    out["memory_bound"] = ((2 + attn_fwd) * elem_attn + (2 + mlp_fwd) * elem_mlp + elem_norm) / (
        gpu.hbm_bandwidth * gpu.hbm_efficiency
    )

    # TP (sequence parallel): the collectives of the attention block and of a TP-sharded MLP (_tp_block).
    tp_t = 0.0
    if plan.tp > 1:
        c = _ring_time(S * b / plan.cp * H * BF16 * (plan.tp - 1) / plan.tp, plan.tp, cluster)
        c_attn = c * tp_width / H
        tp_t = _tp_block(c_attn, attn_fwd, plan.tp, qkv, proj, cluster.tp_comm_overlap, gpu.overlap_contention)
        if tp_block is not None:
            tp_t += _tp_block(
                c, shared_n, plan.tp, tp_block[0], tp_block[1], cluster.tp_comm_overlap, gpu.overlap_contention
            )
    out["tp"] = tp_t

    # CP (folding's K/V all-gather, :mod:`folding.model.context_parallel`): per attention forward an all-gather
    # of K and one of V over CP, per backward a reduce-scatter of dK and one of dV; the attention waits for
    # them (nothing to overlap with), so all are exposed. Plus the sort of the gathered K/V into sequence
    # order and its backward (an index_put into zeros): memory-bound passes over the full-sequence K/V.
    cp_t = 0.0
    if plan.cp > 1 and cfg.mla is not None:
        # MLA: one all-gather of the compressed KV (latent + shared rotary key, replicated over TP) per
        # forward, one reduce-scatter per backward; the sort touches the gathered latents
        m = cfg.mla
        lat_local = S * b / plan.cp * (m.kv_lora_rank + m.qk_rope_head_dim) * BF16
        cp_t = (attn_fwd + 1) * _ring_time(lat_local * (plan.cp - 1), plan.tp * plan.cp, cluster)
        cp_t += (attn_fwd + 1) * lat_local * plan.cp / (gpu.hbm_bandwidth * gpu.hbm_efficiency)
    elif plan.cp > 1:
        kv_local = S * b / plan.cp * cfg.num_kv_heads * cfg.kv_channels / min(plan.tp, cfg.num_kv_heads) * BF16
        one = _ring_time(kv_local * (plan.cp - 1), plan.tp * plan.cp, cluster)
        cp_t = 2 * (attn_fwd + 1) * one
        full_kv = 2 * kv_local * plan.cp
        cp_t += (2 * attn_fwd + 3) * full_kv / (gpu.hbm_bandwidth * gpu.hbm_efficiency)
    out["cp"] = cp_t

    # EP / ETP: all-to-all dispatch + combine, and the ETP all-gather / reduce-scatter.
    ep_t = 0.0
    if moe:
        copies = tok * cfg.moe.topk * H * BF16
        if moe_load is not None:
            copies *= load_a  # what the slowest rank receives
        stride = plan.etp if plan.folded else plan.tp * plan.cp
        a2a = _ep_exchange_time(cfg, plan, stride, copies / cfg.moe.topk, cluster)
        etp = _ring_time(copies * (plan.etp - 1), plan.etp, cluster) if plan.etp > 1 else 0.0
        ep_t = 2 * (mlp_fwd + 1) * (a2a + etp)
        if plan.overlap_moe_comm:
            shared_fwd = shared_bwd = 0.0
            if tp_block is not None:  # the shared expert
                shared_fwd = tp_block[0][0] + tp_block[1][0]
                shared_bwd = train(tp_block[0], shared_n) + train(tp_block[1], shared_n) - shared_fwd
            pieces = MoEPieces(
                attention_fwd=attn_fwd_s + core_t + router_t,
                attention_bwd=attn_t - attn_fwd_s + (1 + core_fwd) * core_t + (1 + mlp_fwd) * router_t,
                experts_fwd=fc1[0] + fc2[0],
                experts_dgrad=(mlp_fwd - 1) * (fc1[0] + fc2[0]) + fc1[1] + fc2[1],
                experts_wgrad=fc1[2] + fc2[2],
                attention_wgrad=attn_wgrad,
                shared_fwd=shared_fwd,
                shared_bwd=shared_bwd,
            )
            ep_t, out["ep_paired"] = exposed_exchanges(
                a2a + etp, pieces, forwards=mlp_fwd, contention=gpu.overlap_contention, delay_wgrad=plan.delay_wgrad
            )
    out["ep"] = ep_t
    out["offload"] = _offload_exposed(cfg, plan, shape, gpu, moe, out["compute"])
    return out


def _offload_exposed(cfg: ModelConfig, plan: Plan, shape: TrainingShape, gpu, moe: bool, compute_s: float) -> float:
    """Seconds per layer and micro-batch that activation offloading adds: the copy of what the offload
    modules keep to host memory during the layer's forward, and back during the backward of the layer above
    (prefetch), each hidden behind that compute (a third / two thirds of the layer's) as far as it lasts."""
    if not plan.offload:
        return 0.0
    nbytes = A.offloaded_bytes_per_layer(
        cfg,
        plan,
        seq_length=shape.seq_length,
        micro_batch_size=shape.micro_batch_size,
        offload=plan.offload,
        recompute=plan.recompute,
        moe_layer=moe,
    )
    copy = nbytes / gpu.host_link_bandwidth
    return max(0.0, copy - compute_s / 3) + max(0.0, copy - 2 * compute_s / 3)


def _ep_exchange_time(cfg: ModelConfig, plan: Plan, stride: int, row_bytes: float, cluster: Cluster) -> float:
    """Seconds of one EP exchange (dispatch or combine) moving ``row_bytes`` per token and row, for the
    plan's dispatcher: ``alltoall`` sends the ``k·(EP-1)/EP`` remote copies, off-node peers over the NIC and
    on-node ones over NVLink at once; ``hierarchical`` (across nodes) sends the expected distinct remote
    nodes' rows over the NIC, then the forwarding hop over NVLink (:mod:`folding.planning.node_dispatch`;
    node-limited when ``moe.num_groups`` / ``moe.group_topk`` are set)."""
    dom = cluster.nvlink_domain
    per_node = max(1, min(plan.ep, dom // stride)) if stride <= dom else 1
    if plan.dispatcher != "hierarchical" or per_node >= plan.ep:
        return _a2a_time(row_bytes * cfg.moe.topk * (plan.ep - 1) / plan.ep, plan.ep, stride, cluster)
    rows = exchange_rows(
        num_experts=cfg.moe.num_experts,
        topk=cfg.moe.topk,
        ep=plan.ep,
        ranks_per_node=per_node,
        dispatcher=plan.dispatcher,
        num_groups=cfg.moe.num_groups,
        group_topk=cfg.moe.group_topk,
    )
    return _staged_a2a_time(row_bytes, rows.nic, rows.nvlink, cluster)


def _last_stage_extra(
    cfg: ModelConfig, plan: Plan, shape: TrainingShape, cluster: Cluster, eff: float, moe_l: dict, dense_l: dict
) -> Dict[str, float]:
    """Seconds per micro-batch, by cause, that the last stage spends beyond its decoder layers: the output
    layer + cross-entropy, and each multi-token-prediction module's transformer layer (``moe_l`` / ``dense_l``
    by its layer number), ``2H -> H`` projection and output layer + cross-entropy.

    The output layer (folding's fused output layer + loss, folding/model/fused_cross_entropy.py) reads the
    TP-gathered input and keeps it: the forward all-gather and the backward reduce-scatter of the input
    gradient (after the fused backward) are exposed, and there is no re-gather; its fp32 logits take a few
    memory-bound passes. An MTP projection runs on the sequence shard with weights replicated over TP (no
    communication); its three norms and the concatenation are memory-bound passes over ``[T, H]`` rows.
    """
    gpu, S, b, H = cluster.gpu, shape.seq_length, shape.micro_batch_size, cfg.hidden_size
    tok = S * b / (plan.tp * plan.cp)
    hbm = gpu.hbm_bandwidth * gpu.hbm_efficiency
    heads = 1 + cfg.mtp_num_layers
    out = {c: 0.0 for c in CAUSES}
    out["compute"] = heads * sum(gemm_train_times(S * b / plan.cp, cfg.padded_vocab_size / plan.tp, H, gpu, eff))
    out["memory_bound"] = heads * 4 * tok * cfg.padded_vocab_size / plan.tp * FP32 / hbm
    if plan.tp > 1:
        out["tp"] = heads * 2 * _ring_time(S * b / plan.cp * H * BF16 * (plan.tp - 1) / plan.tp, plan.tp, cluster)
    for i in range(cfg.num_layers, cfg.num_layers + cfg.mtp_num_layers):
        for c, v in (moe_l if cfg.is_moe_layer(i) else dense_l).items():
            out[c] += v
        out["compute"] += sum(gemm_train_times(tok, H, 2 * H, gpu, eff))
        # forward: 3 norms (read + write H) and the concatenation (2H each way); backward about twice that
        out["memory_bound"] += 3 * 10 * H * BF16 * tok / hbm
    return out


def stage_parameters(cfg: ModelConfig, plan: Plan, *, last: bool) -> Dict[str, float]:
    """Parameters held by one GPU of the first (``last=False``) or last pipeline stage.

    Returns ``{"dense": ..., "expert": ...}``: dense = attention, norms, router, shared expert and the
    embedding (first stage) or output layer (last stage; untied) sharded over TP; expert = routed experts
    sharded over EP·ETP. A one-stage pipeline holds both ends. The last stage also holds the
    multi-token-prediction modules (and its own embedding copy when untied and PP > 1). Counted by the one
    memory model (:func:`folding.planning.memory.param_counts`).
    """
    return _stage_parameters(cfg, plan.tp, plan.pp, plan.ep, plan.etp, plan.pp - 1 if last else 0, _cut(plan))


@functools.lru_cache(maxsize=4096)
def _muon_seconds(cfg: ModelConfig, plan: "Plan", stage: int, gpu) -> float:
    """Newton–Schulz time of one step on a rank of ``stage`` under ``optim.name=muon``: the routed
    experts' fc1 gate/up and fc2 matrices of its MoE layers (split over EDP owners under ZeRO-1), the
    dense and shared-expert MLP matrices (over DP×CP owners), at the TF32 tensor rate (half of bf16's)
    with full efficiency; attention projections are left out (smaller than the MLPs' in the presets).
    Every TP rank orthogonalizes the whole gathered matrix, so TP does not divide the work."""
    n_layers, n_dense = _stage_counts(cfg, plan.pp, plan.vpp or 1, stage, _ends(plan))
    own_e = plan.edp if plan.distributed_optimizer else 1
    own_d = plan.dp * plan.cp if plan.distributed_optimizer else 1
    H, moe = cfg.hidden_size, cfg.moe
    flops = 0.0
    if moe.num_experts and moe.ffn_hidden_size:
        local = moe.num_experts // plan.ep
        flops += (n_layers - n_dense) * math.ceil(3 * local / own_e) * muon_flops(moe.ffn_hidden_size, H)
    if moe.shared_expert_ffn_hidden_size:
        flops += (n_layers - n_dense) * 3 * muon_flops(moe.shared_expert_ffn_hidden_size, H) / own_d
    if cfg.ffn_hidden_size:
        flops += n_dense * 3 * muon_flops(cfg.ffn_hidden_size, H) / own_d
    return flops / (0.5 * gpu.bf16_flops)


Cut = Tuple[Optional[int], Optional[int], Optional[str], int]
"""``(first_stage_layers, last_stage_layers, pipeline_layout, vpp)`` of a plan: how its layers are cut."""


def _cut(plan: Plan) -> Cut:
    return (plan.first_stage_layers, plan.last_stage_layers, plan.pipeline_layout, plan.vpp or 1)


def _ends(plan: Plan):
    """The plan's ``(first_stage_layers, last_stage_layers, pipeline_layout)`` (the memory model's ``Ends``)."""
    return _cut(plan)[:3]


def _stage_parameters(cfg: ModelConfig, tp: int, pp: int, ep: int, etp: int, stage: int, cut: Cut) -> Dict[str, float]:
    first, last, layout, vpp = cut
    plan = Plan(
        tp=tp,
        cp=1,
        pp=pp,
        vpp=vpp,
        ep=ep,
        etp=etp,
        dp=1,
        edp=1,
        distributed_optimizer=False,
        recompute="none",
        last_stage_layers=last,
        first_stage_layers=first,
        pipeline_layout=layout,
    )
    c = param_counts(cfg, plan, stage=stage)
    return {"dense": c.dense, "expert": c.expert}


def rank_layer_counts(cfg: ModelConfig, plan: Plan) -> List[float]:
    """Decoder layers on each pipeline rank (all its virtual stages together; ``L/PP`` each when even, a
    fraction when PP does not divide L), from the one partition
    (:func:`folding.parallel.partition.partition_layers`): the first / last stage split or the
    ``pipeline_layout``'s stages, a stage without transformer layers counting 0."""
    first, last, layout, vpp = _cut(plan)
    if first is None and last is None and layout is None:
        return [cfg.num_layers / plan.pp] * plan.pp
    stages = partition_layers(
        num_layers=cfg.num_layers,
        pp=plan.pp,
        vpp=vpp if layout is not None else None,
        first_stage_layers=first,
        last_stage_layers=last,
        pipeline_layout=layout,
        mtp_num_layers=cfg.mtp_num_layers,
    )
    return [float(sum(e - s for s, e in stages[r :: plan.pp])) for r in range(plan.pp)]


def _stage_kinds(plan: Plan, per_rank) -> list:
    """``(stage, how many such stages, per micro-batch seconds)``: the last stage, the stages between (one
    entry per distinct per-micro-batch time, standing for its ranks as the last of them: PP-2 when all
    are alike), the first, in that order of precedence when they tie; with PP1 the one stage is the last
    (it holds the output layer)."""
    kinds = [(plan.pp - 1, 1, per_rank[-1])]
    between: Dict[tuple, list] = {}
    for r in range(1, plan.pp - 1):
        between.setdefault(tuple(sorted(per_rank[r].items())), []).append(r)
    for ranks in sorted(between.values(), key=lambda rs: -rs[-1]):
        kinds.append((ranks[-1], len(ranks), per_rank[ranks[-1]]))
    if plan.pp > 1:
        kinds.append((0, 1, per_rank[0]))
    return kinds


def _pair_moe_exchanges(cfg: ModelConfig, plan: Plan, m: int, kinds, pair_save: float, counts) -> None:
    """Take off each kind of stage's per-micro-batch ``ep`` (in place) what ``overlap_moe_comm`` hides in
    its paired steady state: ``pair_save`` per MoE layer (decoder and multi-token-prediction ones), times the
    share of its chunk forwards that run paired (:func:`folding.planning.moe_overlap.paired_share`).
    ``counts``: the decoder layers of each pipeline rank (:func:`rank_layer_counts`)."""
    n_moe_mtp = sum(1 for i in range(cfg.num_layers, cfg.num_layers + cfg.mtp_num_layers) if cfg.is_moe_layer(i))
    share = num_moe_layers(cfg) / cfg.num_layers  # the mean decoder layer's MoE share, as in the stage times
    for stage, _, d in kinds:
        p = paired_share(pp=plan.pp, vpp=plan.vpp, stage=stage, num_microbatches=m)
        moe_layers = counts[stage] * share + (n_moe_mtp if stage == plan.pp - 1 else 0)
        d["ep"] -= p * moe_layers * pair_save


_PIPELINE_FIELDS = tuple(f.name for f in dataclasses.fields(Plan) if f.name != "distributed_optimizer")
"""The :class:`Plan` fields the pipeline's stage times depend on: all but the optimizer's sharding, which
only the data-parallel part of the step reads (the planner's two optimizer variants share the rest)."""


@functools.lru_cache(maxsize=16384)
def _pipeline_times(cfg: ModelConfig, key: tuple, shape: TrainingShape, cluster: Cluster, compute_efficiency, moe_load):
    """``(slowest stage, its per-micro-batch seconds by cause, bubble seconds)`` of the plans whose
    :data:`_PIPELINE_FIELDS` are ``key``: the part of :func:`estimate_step_time` before data parallelism
    (the dict is shared by the callers: read it only)."""
    plan = Plan(distributed_optimizer=False, **dict(zip(_PIPELINE_FIELDS, key)))
    gpu, S, b = cluster.gpu, shape.seq_length, shape.micro_batch_size
    H, L, n_moe = cfg.hidden_size, cfg.num_layers, num_moe_layers(cfg)
    m = shape.global_batch_size // (plan.dp * b)
    tok = S * b / (plan.tp * plan.cp)

    moe_l = _layer_times(cfg, plan, shape, cluster, compute_efficiency, moe=True, moe_load=moe_load)
    dense_l = _layer_times(cfg, plan, shape, cluster, compute_efficiency, moe=False)
    # with overlap_moe_comm: what pairing saves per MoE layer and micro-batch (moe_l["ep"] is then unpaired)
    pair_save = moe_l["ep"] - moe_l.pop("ep_paired", moe_l["ep"])
    causes = CAUSES
    layer = {c: (n_moe * moe_l[c] + (L - n_moe) * dense_l[c]) / L for c in causes}  # the mean decoder layer
    # the layers of each pipeline rank (L/PP on every rank when even), the last one's output layer and MTP
    counts = rank_layer_counts(cfg, plan)
    per_rank = [{c: layer[c] * n for c in causes} for n in counts]
    heads = _last_stage_extra(cfg, plan, shape, cluster, compute_efficiency, moe_l, dense_l)
    per_rank[-1] = {c: per_rank[-1][c] + heads[c] for c in causes}
    per_mb = per_rank[1] if plan.pp > 2 else {c: layer[c] * counts[0] for c in causes}  # a rank between

    # Pipeline: send/recv of the (sequence-sharded) activation, forward and backward, per virtual stage.
    pp_t = 0.0
    if plan.pp > 1:
        crosses = cluster.num_gpus // plan.pp >= cluster.nvlink_domain
        act = tok * H * BF16
        send = act / gpu.link_bandwidth(crosses_node=crosses, kind="ring")
        # Interleaved 1F1B posts each chunk's send/recv asynchronously and waits for it only before the chunk
        # that needs it (Megatron-Core's overlap_p2p_comm, on by default with virtual stages): the transfer runs
        # behind a chunk's compute, paying the contention of hidden traffic. Plain 1F1B waits for it.
        if plan.vpp > 1:
            send = hidden_behind(send, sum(per_mb.values()) / plan.vpp, gpu.overlap_contention)
        pp_t = 2 * plan.vpp * (send + gpu.latency(crosses_node=crosses))
    for d in per_rank:
        d["pp"] = pp_t
    kinds = _stage_kinds(plan, per_rank)
    t_mean = sum(n * sum(d.values()) for _, n, d in kinds) / plan.pp
    bubble = (plan.pp - 1) / plan.vpp * t_mean  # fill and drain run unpaired
    if pair_save:
        _pair_moe_exchanges(cfg, plan, m, kinds, pair_save, counts)
    # the pipeline runs at the pace of its slowest stage: the last one, unless an uneven split leaves it
    # lighter than the others
    stage, _, slowest = max(kinds, key=lambda k: sum(k[2].values()))

    return stage, slowest, bubble


def estimate_step_time(
    cfg: ModelConfig,
    plan: Plan,
    *,
    shape: TrainingShape,
    cluster: Cluster,
    compute_efficiency: float,
    moe_load: Optional[Tuple[float, float]] = None,
) -> StepTime:
    """Predicted :class:`StepTime` of ``plan`` for ``cfg`` on ``cluster`` (see the module docstring).

    ``moe_load``: ``(compute, comm)`` load of the slowest EP rank relative to balanced routing, the mean
    over the MoE layers (:mod:`folding.planning.imbalance`): every MoE layer's expert GEMMs, received-row
    passes and exchanges run at that rank's pace. ``None`` (or ``(1.0, 1.0)``): balanced routing."""
    if not 0 < compute_efficiency <= 1:
        raise ValueError(f"compute_efficiency={compute_efficiency!r} must be in (0, 1]")
    gpu, S, b = cluster.gpu, shape.seq_length, shape.micro_batch_size
    m = shape.global_batch_size // (plan.dp * b)
    key = tuple(getattr(plan, f) for f in _PIPELINE_FIELDS)
    stage, slowest, bubble = _pipeline_times(cfg, key, shape, cluster, compute_efficiency, moe_load)

    # Data parallel: gradient reduce-scatter (all-reduce without the distributed optimizer) overlapped with
    # the backward per model chunk (folding starts a chunk's buckets during its last micro-batch's backward,
    # as Megatron-Core's overlap_grad_reduce); dense and expert traffic share the GPU's links. The parameter
    # all-gather of the distributed optimizer starts bucket by bucket as the optimizer updates them and is
    # waited for at the end of the step: it hides only behind the rest of the update (folding has no
    # overlap_param_gather).
    # the slowest stage's parameters
    params = _stage_parameters(cfg, plan.tp, plan.pp, plan.ep, plan.etp, stage, _cut(plan))
    fwd_share = slowest["compute"] / 3
    grad_b = shape.optim_precision.grad_bytes()  # fp32 main grads reduce in fp32 (4 bytes), bf16 in 2
    grad_s = param_s = 0.0
    shard = 0.0
    for kind, n, span in (
        ("dense", plan.dp * plan.cp, plan.tp * plan.cp * plan.dp),
        ("expert", plan.edp, plan.etp * plan.ep * plan.edp),
    ):
        p = params[kind]
        shard += p / n if plan.distributed_optimizer else p
        if n == 1:
            continue
        if plan.distributed_optimizer:
            grad_s += _ring_time((n - 1) / n * p * grad_b, span, cluster)
            param_s += _ring_time((n - 1) / n * p * BF16, span, cluster)
        else:
            grad_s += _ring_time(2 * (n - 1) / n * p * grad_b, span, cluster)
    exposed_grad = _exposed_behind_chunks(grad_s, pp=plan.pp, vpp=plan.vpp, slot_s=2 * fwd_share / plan.vpp)
    traffic = shape.optim_precision.update_traffic_bytes(BF16)  # 30 bytes per element when all fp32
    optimizer = traffic * shard / (gpu.hbm_bandwidth * gpu.hbm_efficiency)
    if shape.optim_precision.name == "muon":
        optimizer += _muon_seconds(cfg, plan, stage, gpu)
        if plan.distributed_optimizer:  # Muon under ZeRO-1: reduced gradients all-gathered, fp32 updates
            for kind, n, span in (  # reduce-scattered, over the same groups (all parameters counted as Muon's)
                ("dense", plan.dp * plan.cp, plan.tp * plan.cp * plan.dp),
                ("expert", plan.edp, plan.etp * plan.ep * plan.edp),
            ):
                if n > 1:
                    param_s += _ring_time((n - 1) / n * params[kind] * (grad_b + 4), span, cluster)
    exposed_dp = (
        exposed_grad
        + gpu.overlap_contention * (grad_s - exposed_grad)
        + hidden_behind(param_s, optimizer, gpu.overlap_contention)
    )

    breakdown = {c: m * v for c, v in slowest.items()}
    breakdown.update(bubble=bubble, dp=exposed_dp, optimizer=optimizer)
    step = sum(breakdown.values())
    tokens = shape.global_batch_size * S
    mfu = _model_flops_per_token(cfg, S) * tokens / (step * cluster.num_gpus * gpu.bf16_flops)
    return StepTime(step_s=step, mfu=mfu, breakdown=breakdown)
