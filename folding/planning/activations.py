"""Activation memory of one rank: what each layer keeps for backward, what the pipeline keeps in flight.

Part of the one memory model (:mod:`folding.planning.memory` re-exports these functions). Every term
is what the engine's own layer keeps, term by term, as :mod:`folding.testing.kept_memory` measures it
(``python -m benchmarks.bench_activation_memory`` prints model against measured for every family,
precision and recompute module). A kept tensor belongs to the term of the part that *creates* it.
Sequence parallelism: ``T = seq*mbs/(TP*CP)`` local tokens; the attention tensors cover the TP-gathered
sequence of this rank's ``1/TP`` of the heads (``T`` tokens' worth of all heads); ``a`` bytes per
activation element; ``R = T*top_k*ETP`` expert rows per rank (balanced routing), ``F_e = F/ETP``.

Kept per layer and micro-batch (no recompute):

- ``input``: the layer's input ``aTh`` (the input norm keeps it); ``residual``: ``h = x + attention``,
  ``aTh`` (the post-attention norm keeps it);
- ``norms``: each RMSNorm's output ``aTh`` (kept by the projections and the router that read it) and one
  fp32 ``rstd`` per token, ``2aTh + 8T``;
- ``attention`` (GQA, flash kernel): queries and keys after RoPE, values, the kernel's output and its
  fp32 log-sum-exp per head, ``aT(nq d + 2 CP nkv d + nq d) + 4T nq`` (the keys and values of the whole
  sequence under CP, whose chunked kernel also keeps each chunk's output); q/k norms keep their inputs
  ``aT(nq + nkv)d`` and their ``rstd``; multi-head latent attention: :func:`_mla_terms`;
- ``router``: fp32 scores ``4E`` per token (post-softmax routing: the logits, and the aux loss's softmax
  ``4E`` more), the chosen experts (int64) and their probabilities;
- ``dispatch``: the expert rows ``aRh`` (fc1's input), their fp32 probabilities ``4R`` and the int64
  token and expert indices of the ``Tk`` routed pairs (the combine keeps indices only);
- ``experts``: fc1's output ``[R, 2F_e]`` (kept by the fused weighted SwiGLU) and the activation, fc2's
  input ``[R, F_e]``: ``3aRF_e`` (``fused_swiglu=False``: plain autograd also keeps ``silu(gate)`` and a
  product, ``5aRF_e``); under ``moe.fp8_recipe`` each expert GEMM keeps its input as FP8 codes and scales,
  fc1's rows ``Rh`` and the activation ``RF_e`` at 1 byte (plus scales, :func:`_fp8_bytes`) in ``experts``
  (``dispatch`` keeps the probabilities and indices only), and ``moe.fp8_act_input_store`` fc1's output too;
- ``shared_expert``: fc1's output ``2aTF_s`` and the activation ``aTF_s``; with its gate, its output
  ``aTh`` and the gate ``aT``; a dense layer's ``mlp``: gate, up and activation, ``3aTF``.

Recompute (:mod:`folding.model.recompute`, the table the model reads too): ``layernorm`` drops the
norms' outputs (``2aTh``; the ``rstd`` stay), ``core_attn`` the kernel's statistics (and under CP the
chunk outputs; on CPU, MLA's padded output), ``mla_up_proj`` MLA's queries, keys and values, ``moe_act``
the activation ``aRF_e``, ``shared_experts`` the shared expert, ``mlp`` a dense MLP, ``moe`` the router,
dispatch, experts and shared expert of an MoE layer; ``full`` keeps only ``input``.

``device``: ``"cpu"`` counts what PyTorch's CPU kernels keep where they differ from a GPU's: MLA's values
zero-padded to the query width, and the kernel's output that wide (:func:`folding.model.context_parallel.
sdpa_values`); the default (``"cuda"``) is the GPU run the planner plans.

On the last stage the final norm keeps its input and ``rstd``, the fused output layer + loss its input and
a log-sum-exp per token; its fp32 logits exist one chunk of tokens at a time (:func:`logits_bytes`).
Multi-token-prediction modules, also on the last stage, keep their transformer layer's tensors (under the
recompute setting, like any layer) and their own norms', projection's and fused loss's inputs
(:func:`mtp_activation_bytes`).

Backward re-materializes one checkpointed region at a time; that working set is part of
:func:`transient_bytes`, with the larger of the dispatcher's buffers and the experts' backward working
set of the layer being run.

Usage::

    cfg = get_preset("mixtral_8x7b")
    per = activation_bytes_per_layer(cfg, layout, seq_length=4096, micro_batch_size=1, recompute="moe")
    terms = activation_terms(cfg, layout, seq_length=4096, micro_batch_size=1, recompute="moe_act")
    n = in_flight_chunks(pp=8, vpp=2, stage=0, num_microbatches=32)   # chunk forwards alive at the peak
"""

from __future__ import annotations

import functools
from typing import Dict, FrozenSet, List, Optional, Tuple

from folding.model.config import OFFLOAD_MODULES, RECOMPUTE_MODES, ModelConfig, recompute_mode  # noqa: F401 - RECOMPUTE_MODES re-exported

TERMS = ("input", "residual", "norms", "attention", "router", "dispatch", "experts", "shared_expert", "mlp")
"""The terms of one layer's kept bytes, in the order a storage kept by several is attributed."""


Storage = Tuple[str, int, FrozenSet[str]]
"""One kept storage of a layer: its term, its bytes, and the offload modules whose regions save it (it leaves
the device only when every one of them offloads; it goes to host memory when any does)."""


@functools.lru_cache(maxsize=65536)
def _storages(
    cfg: ModelConfig,
    tp: int,
    cp: int,
    etp: int,
    seq_length: int,
    micro_batch_size: int,
    a: int,
    moe_layer: bool,
    fused_swiglu: bool,
    recompute: str,
    device: str,
) -> Tuple[Storage, ...]:
    """Every storage one layer keeps under ``recompute`` (the module docstring's terms, one entry per storage)."""
    rc = recompute_mode(recompute)
    h = cfg.hidden_size
    t = seq_length * micro_batch_size // (tp * cp)
    none: FrozenSet[str] = frozenset()
    out: List[Storage] = [("input", a * t * h, frozenset({"attn_norm"}))]
    if rc.whole_layer:
        return tuple(out)
    ln = rc.has("layernorm")
    out += [
        ("residual", a * t * h, frozenset({"mlp_norm"})),
        ("norms", 4 * t, frozenset({"attn_norm"})),  # the input norm's rstd
        ("norms", 4 * t, frozenset({"mlp_norm"})),
        ("norms", 0 if ln else a * t * h, frozenset({"qkv_linear"})),  # the input norm's output
        ("norms", 0 if ln else a * t * h, none),  # the post-attention norm's output (router, MLP)
    ]
    out += _attention_storages(cfg, tp, cp, t, a, rc, device)
    if not moe_layer:
        return tuple(out + [("mlp", 0 if rc.has("mlp") else 3 * a * t * cfg.ffn_hidden_size, none)])
    if rc.has("moe"):
        return tuple(out)
    moe = cfg.moe
    k = moe.topk
    r = t * k * etp
    fe = moe.ffn_hidden_size // etp
    out += [
        ("router", t * _router_per_token(moe), none),
        ("dispatch", 4 * r, frozenset({"moe_act"})),  # the rows' probabilities, the activation's
        ("dispatch", 16 * t * k, none),  # int64 token and expert ids of the routed pairs
        *_expert_storages(moe, r, h, fe, a, fused_swiglu, rc.has("moe_act")),
    ]
    fs = moe.shared_expert_ffn_hidden_size or 0
    if fs and not rc.has("shared_experts"):
        out.append(("shared_expert", 3 * a * t * fs + (a * t * h + a * t if moe.shared_expert_gate else 0), none))
    return tuple(out)


def _expert_storages(moe, r: int, h: int, fe: int, a: int, fused_swiglu: bool, moe_act: bool) -> List[Storage]:
    """What the experts keep on ``r`` rows: fc1's input, the dispatched rows ``aRh`` (in ``dispatch``), fc1's
    output ``2aRF_e`` (the fused SwiGLU's input; ``fused_swiglu=False`` plain autograd also keeps
    ``silu(gate)`` and a product, ``2aRF_e`` more) and the activation, fc2's input ``aRF_e`` (``moe_act``
    drops it). Under ``moe.fp8_recipe`` each GEMM keeps its input quantized along the tokens
    (:func:`_fp8_bytes`): fc1's rows ``Rh`` (then in ``experts``, the bf16 rows being freed) and the
    activation ``RF_e`` (kept whether or not ``moe_act``: the experts discard it only without FP8);
    ``moe.fp8_act_input_store`` keeps fc1's output quantized along its features."""
    recipe = moe.fp8_recipe
    unfused = [("experts", 2 * a * r * fe, frozenset())] if not fused_swiglu else []
    if recipe is None:
        return [
            ("dispatch", a * r * h, frozenset({"expert_fc1"})),  # the expert rows, fc1's input
            ("experts", 2 * a * r * fe, frozenset({"moe_act"})),  # fc1's output, the activation's input
            ("experts", 0 if moe_act else a * r * fe, frozenset()),  # the activation, fc2's input
            *unfused,
        ]
    fc1_out = _fp8_bytes(recipe, r, 2 * fe, along_rows=False) if moe.fp8_act_input_store else 2 * a * r * fe
    groups = moe.num_experts  # per-expert scales counted for every expert: an upper bound under EP
    return [
        ("experts", _fp8_bytes(recipe, r, h, True, groups), frozenset({"expert_fc1"})),  # fc1's FP8 input
        ("experts", fc1_out, frozenset({"moe_act"})),
        ("experts", _fp8_bytes(recipe, r, fe, True, groups), frozenset()),  # fc2's FP8 input
        *unfused,
    ]


def _fp8_bytes(recipe: str, rows: int, width: int, along_rows: bool, groups: int = 1) -> int:
    """Bytes of a ``[rows, width]`` tensor kept in FP8: 1 byte per element plus ``recipe``'s scales, along the
    rows (a GEMM input as its weight gradient reads it, per expert: ``groups`` experts) or along the width.
    Scales: ``mxfp8`` one E8M0 byte per 32 elements, ``blockwise`` one float32 per 128, ``rowwise`` one
    float32 per row of the contraction (along the rows: per column of each expert), ``tensorwise`` and
    ``delayed`` one float32 per tensor (per expert)."""
    if along_rows:  # per column, over each expert's tokens
        scales = {
            "mxfp8": width * -(-rows // 32),
            "blockwise": 4 * width * -(-rows // 128),
            "rowwise": 4 * width * groups,
        }
        return rows * width + scales.get(recipe, 4 * groups)
    scales = {"mxfp8": rows * -(-width // 32), "blockwise": 4 * rows * -(-width // 128), "rowwise": 4 * rows}
    return rows * width + scales.get(recipe, 4)


def _router_per_token(moe) -> int:
    """Bytes the router keeps per token: fp32 scores over the ``E`` experts (post-softmax routing keeps
    its logits, and its aux loss a softmax of them), the top-k choice (int64) and what the score function
    keeps of the chosen scores."""
    E, k = moe.num_experts, moe.topk
    aux = moe.aux_loss_type != "none" and moe.aux_loss_coeff > 0
    if moe.score_function == "sigmoid":  # sigmoid scores, chosen values and their sum (aux: its own sum)
        return 4 * E + 8 * k + 4 * k + 4 + (4 if aux else 0)
    if moe.pre_softmax:  # one softmax over all experts, shared with the aux loss
        return 4 * E + 8 * k
    return 4 * E + (4 * E if aux else 0) + 8 * k + 4 * k  # logits (+ aux softmax), choice, its softmax


def _attention_storages(cfg: ModelConfig, tp: int, cp: int, t: int, a: int, rc, device: str) -> List[Storage]:
    """The attention term's storages: GQA (module docstring) or MLA (:func:`_mla_storages`), under ``rc``."""
    if cfg.mla is not None:
        return _mla_storages(cfg, tp, cp, t, a, rc, device)
    nq, nkv, d = cfg.num_attention_heads, cfg.num_kv_heads, cfg.kv_channels
    core = rc.has("core_attn")
    cat, both = frozenset({"core_attn"}), frozenset({"core_attn", "attn_proj"})
    out = [
        ("attention", a * t * nq * d, cat),  # queries after RoPE
        ("attention", a * t * cp * nkv * d, cat),  # keys (the whole sequence's under CP)
        ("attention", a * t * cp * nkv * d, cat),  # values
        ("attention", a * t * nq * d, both),  # the kernel's output, the output projection's input
        ("attention", 0 if core else 4 * t * nq, cat),  # fp32 log-sum-exp
        ("attention", a * t * nq * d if cp > 1 and not core else 0, cat),  # CP: each chunk's output
    ]
    if cfg.qk_norm == "head":  # the q/k norms' inputs and rstd per head
        out.append(("attention", a * t * (nq + nkv) * d + 4 * t * (nq + nkv), frozenset()))
    elif cfg.qk_norm == "full":  # per token of the TP-gathered sequence
        out.append(("attention", a * t * (nq + nkv) * d + 8 * t * tp, frozenset()))
    return out


def _mla_storages(cfg: ModelConfig, tp: int, cp: int, t: int, a: int, rc, device: str) -> List[Storage]:
    """The storages a multi-head latent attention block keeps on ``t`` local tokens: the down-projections'
    outputs (the latent norms' inputs) and ``rstd``; the TP-gathered latents (the up-projections' input;
    without q LoRA only the compressed KV, on the whole sequence under CP); the core's queries, keys and
    values (``mla_up_proj`` drops them: without q LoRA it keeps the queries; the values are a copy of their
    own, not a view of the KV up-projection's output); the core's output and log-sum-exp; on CPU the
    zero-padded values and the kernel's output that wide, plus the output projection's copy of the narrow
    output."""
    m, N = cfg.mla, cfg.num_attention_heads
    dqk, dv, kv_lat = m.qk_head_dim, m.v_head_dim, m.kv_lora_rank + m.qk_rope_head_dim
    rq = m.q_lora_rank or 0
    cpu = device == "cpu"
    up, core = rc.has("mla_up_proj"), rc.has("core_attn")
    values = cp * N * (dqk if cpu else dv)  # a copy of their own: CPU zero-pads them to the query width
    cat, none = frozenset({"core_attn"}), frozenset()
    out = [
        ("attention", a * t * (rq + kv_lat) + 4 * t * (2 if rq else 1), none),  # down outputs, latent rstd
        ("attention", a * t * tp * (rq + kv_lat if rq else 0) + a * t * tp * cp * kv_lat, none),  # latents
        ("attention", 0 if up and rq else a * t * N * dqk, cat),  # queries
        ("attention", 0 if up else a * t * cp * N * dqk, cat),  # keys
        ("attention", 0 if up else a * t * values, cat),  # values
        ("attention", 0 if core else 4 * t * N, cat),  # fp32 log-sum-exp
    ]
    if cpu:  # the kernel keeps its padded output; the output projection its own narrow copy
        out += [
            ("attention", 0 if core else a * t * N * dqk, cat),
            ("attention", a * t * N * dv, frozenset({"attn_proj"})),
        ]
    else:
        out.append(("attention", a * t * N * dv, frozenset({"core_attn", "attn_proj"})))
    return out


def _terms_of(storages, offload: FrozenSet[str]) -> Dict[str, int]:
    """Bytes per term left on the device when ``offload`` modules move what only they keep."""
    out = dict.fromkeys(TERMS, 0)
    for term, nbytes, keepers in storages:
        if not keepers or not keepers <= offload:
            out[term] += nbytes
    return out


def _host_of(storages, offload: FrozenSet[str]) -> int:
    """Bytes the ``offload`` modules copy to host memory: every storage one of them saves."""
    return sum(nbytes for _, nbytes, keepers in storages if keepers & offload)


def _parts(
    cfg: ModelConfig,
    layout,
    *,
    seq_length: int,
    micro_batch_size: int,
    act_bytes: int,
    moe_layer: bool,
    fused_swiglu: bool = True,
    recompute="none",
    device: str = "cuda",
    offload=(),
) -> Dict[str, int]:
    """Bytes of every term of one layer (:data:`TERMS`) left on the device under ``recompute`` and ``offload``."""
    return _terms_of(
        _layer_storages(
            cfg, layout, seq_length, micro_batch_size, act_bytes, moe_layer, fused_swiglu, recompute, device
        ),
        offload_set(offload),
    )


def _layer_storages(cfg, layout, seq_length, micro_batch_size, act_bytes, moe_layer, fused_swiglu, recompute, device):
    return _storages(
        cfg,
        layout.tp,
        layout.cp,
        layout.etp,
        seq_length,
        micro_batch_size,
        act_bytes,
        moe_layer,
        fused_swiglu,
        recompute_mode(recompute).name,
        device,
    )


def offload_set(offload) -> FrozenSet[str]:
    """The offload modules of a setting: names, or names joined by commas (``train.offload_modules``);
    ``ValueError`` naming the setting for an unknown one."""
    return _offload_set(offload) if isinstance(offload, str) else _offload_set_of(offload)


@functools.lru_cache(maxsize=4096)
def _offload_set(offload: str) -> FrozenSet[str]:
    """:func:`offload_set` of a string, worked out once (the planner asks for every stage of every plan)."""
    return _offload_set_of(offload)


def _offload_set_of(offload) -> FrozenSet[str]:
    names = [m for m in (offload.split(",") if isinstance(offload, str) else offload) if m]
    bad = [m for m in names if m not in OFFLOAD_MODULES]
    if bad:
        raise ValueError(f"train.offload_modules: unknown module(s) {bad}; choose among {', '.join(OFFLOAD_MODULES)}")
    return frozenset(names)


def offloaded_bytes_per_layer(
    cfg: ModelConfig,
    layout,
    *,
    seq_length: int,
    micro_batch_size: int,
    offload,
    recompute="none",
    act_bytes: int = 2,
    moe_layer: bool = True,
    fused_swiglu: bool = True,
    device: str = "cuda",
) -> int:
    """Bytes one layer's ``offload`` modules copy to host memory per micro-batch (on a GPU, pinned host memory;
    what they free on the device is the drop of :func:`activation_bytes_per_layer`)."""
    storages = _layer_storages(
        cfg, layout, seq_length, micro_batch_size, act_bytes, moe_layer, fused_swiglu, recompute, device
    )
    return _host_of(storages, offload_set(offload))


def activation_terms(
    cfg: ModelConfig,
    layout,
    *,
    seq_length: int,
    micro_batch_size: int,
    recompute="none",
    act_bytes: int = 2,
    moe_layer: bool = True,
    fused_swiglu: bool = True,
    device: str = "cuda",
    offload=(),
) -> Dict[str, int]:
    """Bytes one layer keeps for backward on the device, per micro-batch, on one rank, by term (:data:`TERMS`,
    the module docstring); the same arguments as :func:`activation_bytes_per_layer`."""
    return _parts(
        cfg,
        layout,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        act_bytes=act_bytes,
        moe_layer=moe_layer,
        fused_swiglu=fused_swiglu,
        recompute=recompute,
        device=device,
        offload=offload,
    )


def activation_bytes_per_layer(
    cfg: ModelConfig,
    layout,
    *,
    seq_length: int,
    micro_batch_size: int,
    recompute="none",
    act_bytes: int = 2,
    moe_layer: bool = True,
    fused_swiglu: bool = True,
    device: str = "cuda",
    offload=(),
) -> int:
    """Estimated activation bytes one layer keeps for backward on the device, per micro-batch, on one rank:
    the sum of :func:`activation_terms`.

    ``cfg``: the :class:`~folding.model.config.ModelConfig`; ``layout``: a
    :class:`~folding.parallel.ParallelLayout` (or any object with its ``tp, cp, etp`` sizes).
    ``recompute``: a setting of :mod:`folding.model.recompute` (a mode, or modules joined by commas).
    ``moe_layer=False`` estimates a dense layer (a SwiGLU MLP of ``ffn_hidden_size``); ``fused_swiglu``:
    the experts' weighted SwiGLU is one autograd node, as in folding (3F kept per row; ``False``: plain
    autograd, 5F); ``device``: see the module docstring; ``offload``: the offload modules
    (``train.offload_modules``: names, or names joined by commas), whose tensors wait in host memory.
    """
    return sum(
        activation_terms(
            cfg,
            layout,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            recompute=recompute,
            act_bytes=act_bytes,
            moe_layer=moe_layer,
            fused_swiglu=fused_swiglu,
            device=device,
            offload=offload,
        ).values()
    )


def _recomputed(cfg, layout, kw: dict, recompute, moe_layer: bool) -> int:
    """Bytes the largest region ``recompute`` re-materializes at once in backward: the difference of the
    kept bytes without and with it (the whole layer under ``full``)."""
    full = sum(_parts(cfg, layout, moe_layer=moe_layer, recompute="none", **kw).values())
    return full - sum(_parts(cfg, layout, moe_layer=moe_layer, recompute=recompute, **kw).values())


def transient_bytes(
    cfg: ModelConfig,
    layout,
    *,
    seq_length: int,
    micro_batch_size: int,
    recompute="none",
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
    kw = dict(seq_length=seq_length, micro_batch_size=micro_batch_size, act_bytes=act_bytes, fused_swiglu=fused_swiglu)
    a, h = act_bytes, cfg.hidden_size
    t = seq_length * micro_batch_size // (layout.tp * layout.cp)
    dispatch = a * t * cfg.moe.topk * h * (1 + 2 * layout.etp)
    experts_backward = 5 * a * (t * cfg.moe.topk * layout.etp) * (cfg.moe.ffn_hidden_size // layout.etp)
    return max(dispatch, experts_backward) + _recomputed(cfg, layout, kw, recompute, moe_layer=True)


def rope_bytes(cfg: ModelConfig, layout, *, seq_length: int, act_bytes: int = 2) -> int:
    """The RoPE tables one model-chunk forward keeps for every layer of it: cos and sin at this CP rank's
    ``seq/CP`` positions, ``2 a (seq/CP) d`` (``d`` the rotary width), cast once to the activations' dtype."""
    d = cfg.mla.qk_rope_head_dim if cfg.mla is not None else cfg.kv_channels
    return 2 * act_bytes * (seq_length // layout.cp) * d


def logits_bytes(
    cfg: ModelConfig, layout, *, seq_length: int, micro_batch_size: int, act_bytes: int = 2, chunk_tokens: int = 2048
) -> int:
    """Bytes of the final norm and the fused output layer + cross-entropy
    (:mod:`folding.model.fused_cross_entropy`) on the last pipeline stage, for one micro-batch: the norm's
    kept input ``[T, H]`` and ``rstd`` (``T`` sequence-parallel tokens), the loss's kept input ``[tokens, H]``
    (``tokens = seq*mbs/CP``, the TP-gathered sequence chunk), one fp32 log-sum-exp and one int64 label per
    token, plus the fp32 logits of one chunk of ``chunk_tokens`` rows ``[chunk, vocab/TP]`` and their
    softmax (gradient), alive together (when every token fits in one chunk, the softmax is kept from
    forward to backward instead of recomputed: the same bytes at the peak)."""
    tokens = seq_length * micro_batch_size // layout.cp
    t = tokens // layout.tp
    chunk = min(chunk_tokens, tokens)
    norm = act_bytes * t * cfg.hidden_size + 4 * t
    loss = act_bytes * tokens * cfg.hidden_size + 4 * tokens + 8 * tokens
    return norm + loss + 2 * 4 * chunk * (cfg.padded_vocab_size // layout.tp)


def mtp_activation_bytes(
    cfg: ModelConfig,
    layout,
    *,
    seq_length: int,
    micro_batch_size: int,
    recompute="none",
    act_bytes: int = 2,
    fused_swiglu: bool = True,
    device: str = "cuda",
    chunk_tokens: int = 2048,
    offload=(),
) -> int:
    """Estimated bytes the multi-token-prediction modules keep for backward, per micro-batch, on the last
    pipeline stage (0 without them).

    Per module: its transformer layer (:func:`activation_bytes_per_layer`, MoE or dense by
    ``ModelConfig.is_moe_layer``, under ``recompute`` like any layer) plus, never recomputed, on the rank's ``T``
    sequence-parallel tokens the inputs of its embedding and hidden-state norms ``2aTH`` (the latter, the previous
    depth's normed output, is the previous loss's own input when TP = 1: then only ``aTH``), of the ``2H -> H``
    projection ``2aTH`` and of its output norm ``aTH``, the three norms' ``rstd`` ``12T``, and its fused output
    layer + loss's input ``[seq*mbs/CP, H]`` with one fp32 log-sum-exp per token, and the int64 ids and labels
    of its shifted tokens (its fp32 logits chunks are transient and run after the model's, so
    :func:`logits_bytes` counts the one chunk alive; but when all ``tokens`` fit in one chunk of
    ``chunk_tokens``, each module's loss keeps its softmax ``[tokens, vocab/TP]`` fp32 until backward).
    """
    recompute_mode(recompute)
    a, h = act_bytes, cfg.hidden_size
    t = seq_length * micro_batch_size // (layout.tp * layout.cp)
    tokens = seq_length * micro_batch_size // layout.cp
    # the hidden-state norm's input is the previous loss's input itself when TP = 1 (no gather between them)
    extra = a * t * (5 if layout.tp > 1 else 4) * h + 12 * t + a * tokens * h + 4 * tokens + 16 * tokens
    if tokens <= chunk_tokens:
        extra += 4 * tokens * (cfg.padded_vocab_size // layout.tp)
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
            device=device,
            offload=offload,
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
