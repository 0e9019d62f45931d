"""Activation memory of one rank: what each layer keeps for backward, what the pipeline keeps in flight.

Part of the one memory model (:mod:`folding.planning.memory` re-exports these functions). Estimates
for bf16 activations, flash attention (no ``s^2`` term) and sequence parallelism (every saved tensor
is the rank's ``T = seq*mbs/(TP*CP)`` tokens; what TP all-gathers is re-gathered in backward, not
kept). ``R = T*top_k*ETP`` expert rows per rank (balanced routing), ``a`` bytes per element,
``F_e = moe.ffn_hidden_size/ETP``; the sizes are a :class:`~folding.model.config.ModelConfig`'s.

Kept per layer and micro-batch (``recompute="none"``):

- norms: the inputs of both RMSNorms, ``2aTh``;
- attention sublayer: QKV input, Q after RoPE, K/V as the attention core reads them (all-gathered over CP:
  the whole sequence's keys, :mod:`folding.model.context_parallel`), the attention output,
  ``aT(h + nq d + 2 nkv d CP + nq d)``; multi-head latent attention keeps its latents too (the
  TP-gathered ones whole, and the CP-gathered compressed KV), see :func:`_mla_kept_per_token`;
- MoE sublayer: router input ``aTh`` and fp32 logits + probabilities ``8TE``; the expert input
  ``aRh`` (kept by fc1); the experts' probability-weighted SwiGLU (:mod:`folding.moe.experts.swiglu`, one
  autograd node) keeps fc1's output ``[R, 2F_e]`` and the fp32 probabilities ``4R``, and fc2 keeps
  its input ``[R, F_e]``: ``3aRF_e + 4R`` (``fused_swiglu=False`` estimates an engine whose
  activation is plain autograd, which also keeps ``silu(gate)`` and ``silu(gate)*up``: ``5aRF_e + 4R``).
  Permute, all-to-all and unpermute keep only indices (``index_select`` / ``index_add``),
  so the permuted copies are transient. A shared expert or dense MLP adds its input and
  ``width + 2F`` per token.

Recompute modes are those of :mod:`folding.model.recompute` (the table the model reads too):

- ``selective``: the attention sublayer (input norm + attention) is checkpointed: its tensors are
  dropped (its input is the layer input, kept by the norms term);
- ``moe``: the MoE sublayer (post-attention norm + router + dispatch + experts) of MoE layers is
  checkpointed: router and expert tensors are dropped; dense layers keep everything;
- ``full``: each layer keeps only its input ``aTh``.

On the last stage the fused output layer + loss keeps its input and a log-sum-exp per token; its fp32
logits exist one chunk of tokens at a time (:func:`logits_bytes`). Multi-token-prediction modules, also
on the last stage, keep their transformer layer's tensors (under the recompute mode, like any layer) and
their own norms', projection's and fused loss's inputs (:func:`mtp_activation_bytes`).

Backward re-materializes one checkpointed region at a time; that working set is part of
:func:`transient_bytes`, with the larger of the dispatcher's buffers and the experts' backward working
set of the layer being run.

Usage::

    cfg = get_preset("mixtral_8x7b")
    per = activation_bytes_per_layer(cfg, layout, seq_length=4096, micro_batch_size=1, recompute="moe")
    n = in_flight_chunks(pp=8, vpp=2, stage=0, num_microbatches=32)   # chunk forwards alive at the peak
"""

from __future__ import annotations

import functools
from typing import Optional

from folding.model.config import RECOMPUTE_MODES, ModelConfig, recompute_mode  # noqa: F401 - RECOMPUTE_MODES re-exported


def _parts(
    cfg: ModelConfig,
    layout,
    *,
    seq_length: int,
    micro_batch_size: int,
    act_bytes: int,
    moe_layer: bool,
    fused_swiglu: bool = True,
) -> dict:
    """Bytes of every kept tensor group of one layer (no recompute)."""
    return _parts_cached(
        cfg, layout.tp, layout.cp, layout.etp, seq_length, micro_batch_size, act_bytes, moe_layer, fused_swiglu
    )


@functools.lru_cache(maxsize=65536)
def _parts_cached(
    cfg: ModelConfig,
    tp: int,
    cp: int,
    etp: int,
    seq_length: int,
    micro_batch_size: int,
    act_bytes: int,
    moe_layer: bool,
    fused_swiglu: bool,
) -> dict:
    a, h = act_bytes, cfg.hidden_size
    t = seq_length * micro_batch_size // (tp * cp)
    if cfg.mla is not None:
        attn = a * t * _mla_kept_per_token(cfg, tp, cp)
    else:
        nq, nkv, d = cfg.num_attention_heads, cfg.num_kv_heads, cfg.kv_channels
        attn = a * t * (h + nq * d + 2 * nkv * d * cp + nq * d)
    mlp = 0
    f = (cfg.moe.shared_expert_ffn_hidden_size or 0) if moe_layer else cfg.ffn_hidden_size  # a SwiGLU MLP
    if f:
        mlp = a * t * h + a * t * (2 * f + 2 * f)  # [S, F/TP] = T*F elements
    router = experts = 0
    if moe_layer:
        r = t * cfg.moe.topk * etp
        fe = cfg.moe.ffn_hidden_size // etp
        router = a * t * h + 8 * t * cfg.moe.num_experts
        experts = a * r * h + (3 if fused_swiglu else 5) * a * r * fe + 4 * r
    return {
        "input": a * t * h,
        "norms": 2 * a * t * h,
        "attention": attn,
        "router": router,
        "experts": experts,
        "mlp": mlp,
    }


def _mla_kept_per_token(cfg: ModelConfig, tp: int, cp: int) -> float:
    """Elements an MLA block keeps per local token (``T`` = the rank's sequence shard): its input; the
    latents on the shard (down-projection outputs and normed latents); the TP-gathered latents (kept as
    the up-projections' input, ``TP`` times the shard); the rotated queries ``N·(dn+dr)/TP`` per CP-chunk
    token; the CP-gathered compressed KV and the whole sequence's keys and values (``CP`` times); the
    attention output."""
    m, h, n = cfg.mla, cfg.hidden_size, cfg.num_attention_heads
    kv_lat = m.kv_lora_rank + m.qk_rope_head_dim
    lat = (m.q_lora_rank or 0) + kv_lat
    return (
        h
        + 2 * lat
        + tp * lat
        + n * m.qk_head_dim
        + cp * (tp * kv_lat + n * (m.qk_head_dim + m.v_head_dim))
        + n * m.v_head_dim
    )


def activation_bytes_per_layer(
    cfg: ModelConfig,
    layout,
    *,
    seq_length: int,
    micro_batch_size: int,
    recompute: str = "none",
    act_bytes: int = 2,
    moe_layer: bool = True,
    fused_swiglu: bool = True,
) -> int:
    """Estimated activation bytes one layer keeps for backward, per micro-batch, on one rank.

    ``cfg``: the :class:`~folding.model.config.ModelConfig`; ``layout``: a
    :class:`~folding.parallel.ParallelLayout` (or any object with its ``tp, cp, etp`` sizes).
    ``moe_layer=False`` estimates a dense layer (a SwiGLU MLP of ``ffn_hidden_size``); ``fused_swiglu``:
    the experts' weighted SwiGLU is one autograd node, as in folding (3F kept per row; ``False``: plain
    autograd, 5F). See the module docstring for the terms and the recompute modes.
    """
    mode = recompute_mode(recompute)
    p = _parts(
        cfg,
        layout,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        act_bytes=act_bytes,
        moe_layer=moe_layer,
        fused_swiglu=fused_swiglu,
    )
    if mode.whole_layer:
        return p["input"]
    return p["norms"] + p["attention"] + p["router"] + p["experts"] + p["mlp"] - _recomputed(p, mode, moe_layer)


def _recomputed(p: dict, mode, moe_layer: bool) -> int:
    """Bytes of the sublayers ``mode`` recomputes (:mod:`folding.model.recompute`), of the parts ``p``
    of a layer (the whole layer's kept tensors under ``whole_layer``)."""
    if mode.whole_layer:
        return p["norms"] + p["attention"] + p["router"] + p["experts"] + p["mlp"]
    attention = p["attention"] if mode.attention else 0
    return attention + (p["router"] + p["experts"] + p["mlp"] if mode.mlp(moe_layer=moe_layer) else 0)


def transient_bytes(
    cfg: ModelConfig,
    layout,
    *,
    seq_length: int,
    micro_batch_size: int,
    recompute: str = "none",
    act_bytes: int = 2,
    fused_swiglu: bool = True,
) -> int:
    """Peak bytes of short-lived buffers while one layer runs: the larger of the dispatcher's buffers in
    forward (the permuted send buffer ``aTkh``, the all-to-all / ETP all-gather receive buffer and its
    expert-sorted copy, ``2aRh``) and the experts' backward working set (fc2's input gradient, ``silu(gate)``
    and ``grad·up`` ``[R, F]`` each, and fc1's output gradient ``[R, 2F]``: ``5aRF``), which are never alive
    together, plus, under recompute, the largest region re-materialized in backward. With
    ``per_expert_exchange`` (no ETP) the all-to-all dispatcher receives expert-major and makes no sorted
    copy: there this counts ``aRh`` too many (a conservative estimate)."""
    mode = recompute_mode(recompute)
    p = _parts(
        cfg,
        layout,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        act_bytes=act_bytes,
        moe_layer=True,
        fused_swiglu=fused_swiglu,
    )
    a, h = act_bytes, cfg.hidden_size
    t = seq_length * micro_batch_size // (layout.tp * layout.cp)
    dispatch = a * t * cfg.moe.topk * h * (1 + 2 * layout.etp)
    experts_backward = 5 * a * (t * cfg.moe.topk * layout.etp) * (cfg.moe.ffn_hidden_size // layout.etp)
    return max(dispatch, experts_backward) + _recomputed(p, mode, moe_layer=True)


def logits_bytes(
    cfg: ModelConfig, layout, *, seq_length: int, micro_batch_size: int, act_bytes: int = 2, chunk_tokens: int = 2048
) -> int:
    """Bytes of the fused output layer + cross-entropy (:mod:`folding.model.fused_cross_entropy`) on the last
    pipeline stage, for one micro-batch of ``tokens = seq*mbs/CP`` (the TP-gathered sequence chunk): its kept
    input ``[tokens, H]`` and one fp32 log-sum-exp per token, plus the fp32 logits of one chunk of
    ``chunk_tokens`` rows ``[chunk, vocab/TP]`` and their softmax (gradient), alive together."""
    tokens = seq_length * micro_batch_size // layout.cp
    chunk = min(chunk_tokens, tokens)
    return act_bytes * tokens * cfg.hidden_size + 4 * tokens + 2 * 4 * chunk * (cfg.vocab_size // layout.tp)


def mtp_activation_bytes(
    cfg: ModelConfig,
    layout,
    *,
    seq_length: int,
    micro_batch_size: int,
    recompute: str = "none",
    act_bytes: int = 2,
    fused_swiglu: bool = True,
) -> int:
    """Estimated bytes the multi-token-prediction modules keep for backward, per micro-batch, on the last
    pipeline stage (0 without them).

    Per module: its transformer layer (:func:`activation_bytes_per_layer`, MoE or dense by
    ``ModelConfig.is_moe_layer``, under ``recompute`` like any layer) plus, never recomputed, on the rank's ``T``
    sequence-parallel tokens the inputs of its embedding and hidden-state norms ``2aTH``, of the ``2H -> H``
    projection ``2aTH`` and of its output norm ``aTH``, and its fused output layer + loss's input
    ``[seq*mbs/CP, H]`` with one fp32 log-sum-exp per token (its fp32 logits chunks are transient and run
    after the model's, so :func:`logits_bytes` counts the one chunk alive).
    """
    recompute_mode(recompute)
    a, h = act_bytes, cfg.hidden_size
    t = seq_length * micro_batch_size // (layout.tp * layout.cp)
    tokens = seq_length * micro_batch_size // layout.cp
    extra = a * t * 5 * h + a * tokens * h + 4 * tokens
    total = 0
    for i in cfg.layer_numbers()[cfg.num_layers :]:
        layer = activation_bytes_per_layer(
            cfg,
            layout,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            recompute=recompute,
            act_bytes=act_bytes,
            moe_layer=cfg.is_moe_layer(i),
            fused_swiglu=fused_swiglu,
        )
        total += layer + extra
    return total


def in_flight_chunks(
    *, pp: int, vpp: int, stage: int, num_microbatches: Optional[int] = None, overlap_moe_comm: bool = False
) -> int:
    """Model-chunk forwards whose activations pipeline rank ``stage`` holds at its peak.

    1F1B (``vpp == 1``): ``pp - stage`` micro-batches (warm-up forwards plus the one of the steady
    state). Interleaved 1F1B: ``2(pp - stage - 1) + (vpp - 1)pp + 1`` chunk forwards, each of
    ``1/vpp`` of the rank's layers (Megatron-Core's warm-up count). ``overlap_moe_comm``
    (:mod:`folding.planning.moe_overlap`, :func:`folding.pipeline.order.schedule_order`): the warm-up
    that lets the steady state pair each forward with a backward while the stages still work side by
    side: interleaved, one more chunk forward; 1F1B, ``2(pp - stage)`` micro-batches (its warm-ups differ
    by 2 between neighbouring stages); no pipelining, 2. All are capped by the ``num_microbatches * vpp``
    forwards a step has (``None``: no cap).
    """
    if not 0 <= stage < pp:
        raise ValueError(f"stage={stage} is not a pipeline stage of pp={pp}")
    if vpp <= 1:
        n = 2 * (pp - stage) if overlap_moe_comm else pp - stage
    else:
        n = 2 * (pp - stage - 1) + (vpp - 1) * pp + 1 + (1 if overlap_moe_comm else 0)
    if num_microbatches is not None:
        n = min(n, num_microbatches * max(vpp, 1))
    return n
