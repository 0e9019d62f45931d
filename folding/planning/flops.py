"""FLOPs per token of a decoder-only MoE transformer: the numerator of TFLOP/s and MFU.

Counting rules (one multiply-add = 2 FLOPs; matrix multiplications only, element-wise work is not
counted, as in Megatron-Core's and PaLM's MFU):

- QKV projection: ``2·H·(h + 2·g)·d`` per token (h query heads, g KV heads, head width d); the q/k/v
  bias adds nothing that counts.
- Attention core (``Q·Kᵀ`` and ``P·V``): ``2 · 2·h·d·s_kv`` per token, where a causal mask makes the
  average key length ``s_kv = s/2`` (FlashAttention skips the masked half, so we count it half).
- Output projection: ``2·h·d·H``.
- Multi-head latent attention (DeepSeek-V3) instead: ``2·(H·Rq + Rq·N·(dn+dr) + H·(Rkv+dr) +
  Rkv·N·(dn+dv) + N·dv·H)`` for the projections and ``2·N·(dn+dr+dv)·s_kv`` for the core (model FLOPs;
  under CP each rank also expands the whole sequence's keys and values, which the step time counts as
  hardware work).
- Router: ``2·H·E``. Routed experts (SwiGLU, three ``H×F`` matrices): ``k · 6·H·F`` (top-k experts per
  token). Shared expert: ``6·H·F_shared`` plus its sigmoid gate ``2·H``. Dense MLP layers: ``6·H·F_dense``.
- Output layer (logits): ``2·H·V``. The embedding lookup is not a matmul and counts 0.
- Multi-token prediction (DeepSeek-V3, ``mtp_num_layers`` D): each module adds one transformer layer
  (counted with the layers above, MoE or dense by its layer number), its ``2H -> H`` projection
  ``2·2H·H`` and one more output layer ``2·H·V`` (its cross-entropy, like the model's, is element-wise).
  They run in training (with labels), so they are model FLOPs.
- Backward = 2 × forward, so training = 3 × forward. Activation recomputation adds FLOPs that the hardware
  executes but that MFU does not count; the modes are those of ``train.recompute``
  (:class:`folding.model.block.TransformerLayer`): ``selective`` re-runs the attention sublayer's forward
  (projections and core), ``moe`` re-runs the MoE sublayer of MoE layers (router, routed and shared
  experts), ``full`` re-runs each transformer layer's forward (not the output layers nor the MTP
  projections). The MTP modules' layers recompute like any layer.

Usage::

    from folding.model.presets import get_preset
    f = flops_per_token(get_preset("mixtral_8x22b"), seq_length=4096)
    f.forward, f.model_training            # ≈ 80.7e9, 3 × that
    f.hardware_training("full")            # what the GPUs execute with full recompute
"""

from __future__ import annotations

import dataclasses

from folding.model.config import ModelConfig, recompute_mode


def attention_linear_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of one layer's QKV and output projections (MLA: its down- and
    up-projections and the output projection, :func:`mla_linear_flops`)."""
    if cfg.mla is not None:
        return sum(mla_linear_flops(cfg).values())
    H, d, h, g = cfg.hidden_size, cfg.kv_channels, cfg.num_attention_heads, cfg.num_kv_heads
    return 2.0 * H * (h + 2 * g) * d + 2.0 * h * d * H


def mla_linear_flops(cfg: ModelConfig) -> dict:
    """Forward FLOPs per token of one multi-head latent attention block's GEMMs, by projection:
    ``q_down`` (``H·Rq``; 0 without q LoRA), ``q_up`` (``Rq·N·(dn+dr)``, or ``H·N·(dn+dr)``),
    ``kv_down`` (``H·(Rkv+dr)``), ``kv_up`` (``Rkv·N·(dn+dv)``), ``out`` (``N·dv·H``), each times 2."""
    m, H, N = cfg.mla, cfg.hidden_size, cfg.num_attention_heads
    q_in = m.q_lora_rank or H
    return {
        "q_down": 2.0 * H * (m.q_lora_rank or 0),
        "q_up": 2.0 * q_in * N * m.qk_head_dim,
        "kv_down": 2.0 * H * (m.kv_lora_rank + m.qk_rope_head_dim),
        "kv_up": 2.0 * m.kv_lora_rank * N * (m.qk_nope_head_dim + m.v_head_dim),
        "out": 2.0 * N * m.v_head_dim * H,
    }


def attention_core_flops(cfg: ModelConfig, seq_length: int) -> float:
    """Forward FLOPs per token of one layer's causal ``softmax(Q·Kᵀ)·V`` (average key length ``s/2``;
    MLA: ``Q·Kᵀ`` over ``dn+dr`` dims and ``P·V`` over ``dv``)."""
    if cfg.mla is not None:
        N, m = cfg.num_attention_heads, cfg.mla
        return 2.0 * N * (m.qk_head_dim + m.v_head_dim) * seq_length / 2.0
    return 2.0 * 2.0 * cfg.num_attention_heads * cfg.kv_channels * seq_length / 2.0


def routed_expert_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of one MoE layer's routed experts (top-k SwiGLU experts)."""
    return cfg.moe.topk * 6.0 * cfg.hidden_size * cfg.moe.ffn_hidden_size


def shared_expert_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of one MoE layer's shared expert and its gate (0 without one)."""
    if not cfg.moe.shared_expert_ffn_hidden_size:
        return 0.0
    gate = 2.0 * cfg.hidden_size if cfg.moe.shared_expert_gate else 0.0
    return 6.0 * cfg.hidden_size * cfg.moe.shared_expert_ffn_hidden_size + gate


def router_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of one MoE layer's router (``x·Wᵀ``, W is ``[E, H]``)."""
    return 2.0 * cfg.hidden_size * cfg.moe.num_experts


def dense_mlp_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of one dense (non-MoE) SwiGLU MLP layer."""
    return 6.0 * cfg.hidden_size * cfg.ffn_hidden_size


def output_layer_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of the output layer (logits over the vocabulary)."""
    return 2.0 * cfg.hidden_size * cfg.padded_vocab_size


def mtp_projection_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of one multi-token-prediction module's ``2H -> H`` projection (``eh_proj``)."""
    return 2.0 * 2 * cfg.hidden_size * cfg.hidden_size


@dataclasses.dataclass(frozen=True)
class FlopsPerToken:
    """Forward FLOPs per token of the whole model, by component (summed over layers)."""

    attention_linear: float
    """QKV and output projections, all layers (the multi-token-prediction layers included, as in every
    per-layer field)."""
    attention_core: float
    """Causal attention core, all layers."""
    router: float
    """Routers of the MoE layers."""
    routed_experts: float
    """Top-k routed experts of the MoE layers."""
    shared_experts: float
    """Shared experts (and gates) of the MoE layers."""
    dense_mlp: float
    """MLPs of the dense layers."""
    output_layer: float
    """Output layer (logits) of the model."""
    mtp_projection: float = 0.0
    """``2H -> H`` projections of the multi-token-prediction modules (0 without them)."""
    mtp_output_layer: float = 0.0
    """The multi-token-prediction modules' output layers (logits), one per module."""
    mla_up_proj: float = 0.0
    """Of ``attention_linear``: multi-head latent attention's up-projections (``q_up``, ``kv_up``), all
    layers (what the ``mla_up_proj`` recompute module runs again; 0 without MLA)."""

    @property
    def forward(self) -> float:
        """Total forward FLOPs per token."""
        return (
            self.attention_linear
            + self.attention_core
            + self.router
            + self.routed_experts
            + self.shared_experts
            + self.dense_mlp
            + self.output_layer
            + self.mtp_projection
            + self.mtp_output_layer
        )

    @property
    def model_training(self) -> float:
        """Model FLOPs per trained token, ``3 × forward``: the MFU numerator (recompute not counted)."""
        return 3.0 * self.forward

    def recompute_extra(self, recompute: str) -> float:
        """FLOPs per token that activation recomputation adds, for a setting of :mod:`folding.model.recompute`
        (a mode or modules): the GEMMs and the attention core the recomputed parts run again
        (``layernorm`` and ``moe_act`` recompute element-wise work only)."""
        rc = recompute_mode(recompute)  # the one table: folding.model.recompute
        if rc.whole_layer:
            return self.forward - self.output_layer - self.mtp_projection - self.mtp_output_layer
        extra = 0.0
        if rc.has("core_attn"):
            extra += self.attention_core
        if rc.has("mla_up_proj"):
            extra += self.mla_up_proj
        if rc.has("moe"):
            extra += self.router + self.routed_experts + self.shared_experts
        elif rc.has("shared_experts"):
            extra += self.shared_experts
        if rc.has("mlp"):
            extra += self.dense_mlp
        return extra

    def hardware_training(self, recompute: str = "none") -> float:
        """FLOPs per trained token that the GPUs execute: model FLOPs plus the recompute extra."""
        return self.model_training + self.recompute_extra(recompute)


def flops_per_token(cfg: ModelConfig, seq_length: int) -> FlopsPerToken:
    """Forward FLOPs per token of ``cfg`` trained on sequences of ``seq_length`` tokens, by component."""
    if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 1:
        raise ValueError(f"seq_length={seq_length!r} must be an integer >= 1")
    layers = cfg.layer_numbers()  # the decoder's and the multi-token-prediction modules'
    n_moe = sum(cfg.is_moe_layer(i) for i in layers)
    n_dense = len(layers) - n_moe
    return FlopsPerToken(
        attention_linear=len(layers) * attention_linear_flops(cfg),
        attention_core=len(layers) * attention_core_flops(cfg, seq_length),
        router=n_moe * router_flops(cfg),
        routed_experts=n_moe * routed_expert_flops(cfg),
        shared_experts=n_moe * shared_expert_flops(cfg),
        dense_mlp=n_dense * dense_mlp_flops(cfg),
        output_layer=output_layer_flops(cfg),
        mtp_projection=cfg.mtp_num_layers * mtp_projection_flops(cfg),
        mtp_output_layer=cfg.mtp_num_layers * output_layer_flops(cfg),
        mla_up_proj=len(layers) * _mla_up_flops(cfg),
    )


def _mla_up_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of one MLA block's up-projections (0 without MLA)."""
    if cfg.mla is None:
        return 0.0
    parts = mla_linear_flops(cfg)
    return parts["q_up"] + parts["kv_up"]


def mfu(
    cfg: ModelConfig, *, seq_length: int, tokens_per_second: float, num_gpus: int, peak_flops_per_gpu: float
) -> float:
    """Model FLOPs utilization: model training FLOPs per second over the cluster's peak (a fraction)."""
    achieved = flops_per_token(cfg, seq_length).model_training * tokens_per_second
    return achieved / (num_gpus * peak_flops_per_gpu)
