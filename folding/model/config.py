"""Architecture of a decoder-only MoE transformer (Mixtral, Qwen2-MoE and kin) and its parameter count.

A :class:`ModelConfig` says *what* the model is, never how it is parallelized. Presets with the
published hyper-parameters live in :mod:`folding.model.presets`.

Usage::

    from folding.model.presets import get_preset
    cfg = get_preset("mixtral_8x7b")
    total, active = cfg.num_parameters()      # 46.7e9, 12.9e9
    cfg.is_moe_layer(0)                       # True
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

FAMILIES = ("mixtral", "qwen2_moe")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only MoE transformer (field names follow Megatron-Core where they exist)."""

    name: str
    """Preset name (``mixtral_8x7b``, ``mixtral_tiny``, ...)."""
    family: str
    """``mixtral`` or ``qwen2_moe``: selects the Hugging Face mapping and architectural details."""
    vocab_size: int
    """Vocabulary size of the tokenizer / checkpoint (before any padding for TP)."""
    hidden_size: int
    """Model width H."""
    num_layers: int
    """Number of transformer layers."""
    num_attention_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA); must divide ``num_attention_heads``."""
    head_dim: Optional[int] = None
    """Per-head width; ``None`` means ``hidden_size // num_attention_heads``."""
    ffn_hidden_size: int = 0
    """FFN width of dense (non-MoE) layers; 0 when every layer is MoE."""
    num_experts: int = 8
    """Routed experts per MoE layer."""
    topk: int = 2
    """Experts per token."""
    moe_ffn_hidden_size: int = 0
    """FFN width F of one routed expert."""
    shared_expert_ffn_hidden_size: Optional[int] = None
    """FFN width of the shared expert (Qwen2-MoE); ``None`` for no shared expert."""
    shared_expert_gate: bool = False
    """Sigmoid gate ``[1, H]`` on the shared expert output (Qwen2-MoE)."""
    decoder_sparse_step: int = 1
    """Every ``decoder_sparse_step``-th layer is MoE (Qwen2-MoE: layer i is MoE when (i+1) % step == 0)."""
    mlp_only_layers: Tuple[int, ...] = ()
    """Layer indices that use a dense MLP whatever the sparse step (Qwen2-MoE)."""
    score_function: str = "softmax"
    """Router score function: ``softmax`` or ``sigmoid``."""
    pre_softmax: bool = False
    """Softmax over all experts before top-k (Qwen2-MoE with ``norm_topk_prob=false``)."""
    norm_topk_prob: bool = True
    """Renormalize the top-k probabilities (Mixtral: implied by post-softmax; Qwen2-MoE option)."""
    router_aux_loss_coef: float = 0.0
    """Default load-balancing loss coefficient of the architecture."""
    qkv_bias: bool = False
    """Bias on the q/k/v projections (Qwen2-MoE)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    max_position_embeddings: int = 4096
    """Longest supported sequence."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding and the output layer weight."""
    init_std: float = 0.02
    """Standard deviation of the normal initialization."""

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"model.family={self.family!r}: choose one of {FAMILIES}")
        for f in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_kv_heads",
            "num_experts",
            "topk",
            "decoder_sparse_step",
        ):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model.{f}={v!r} must be an integer >= 1")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_kv_heads={self.num_kv_heads} must divide "
                f"model.num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}; set model.head_dim"
            )
        if self.topk > self.num_experts:
            raise ValueError(f"model.topk={self.topk} exceeds model.num_experts={self.num_experts}")
        if self.moe_ffn_hidden_size < 1:
            raise ValueError(f"model.moe_ffn_hidden_size={self.moe_ffn_hidden_size} must be >= 1")
        if any(not self.is_moe_layer(i) for i in range(self.num_layers)) and self.ffn_hidden_size < 1:
            raise ValueError(
                "model.ffn_hidden_size must be >= 1 when some layers are dense "
                "(model.mlp_only_layers / model.decoder_sparse_step)"
            )

    # ------------------------------------------------------------------------------ derived
    @property
    def kv_channels(self) -> int:
        """Per-head width (``head_dim`` or ``hidden_size // num_attention_heads``)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` (0-based) has an MoE block rather than a dense MLP."""
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def num_moe_layers(self) -> int:
        """Number of MoE layers."""
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def attention_params(self) -> int:
        """Parameters of one attention block (q, k, v, o projections, q/k/v biases, input norm)."""
        d, h, kv = self.kv_channels, self.num_attention_heads, self.num_kv_heads
        H = self.hidden_size
        n = H * d * h + 2 * H * d * kv + d * h * H + H
        if self.qkv_bias:
            n += d * h + 2 * d * kv
        return n

    def expert_params(self) -> int:
        """Parameters of one routed expert (SwiGLU: gate, up, down)."""
        return 3 * self.hidden_size * self.moe_ffn_hidden_size

    def shared_expert_params(self) -> int:
        """Parameters of the shared expert and its gate (0 without one)."""
        if not self.shared_expert_ffn_hidden_size:
            return 0
        return 3 * self.hidden_size * self.shared_expert_ffn_hidden_size + (
            self.hidden_size if self.shared_expert_gate else 0
        )

    def num_parameters(self) -> Tuple[int, int]:
        """``(total, active)`` parameter counts; active counts ``topk`` routed experts per token."""
        H = self.hidden_size
        emb = self.vocab_size * H * (1 if self.tie_embeddings else 2) + H  # + final norm
        total = active = emb
        for i in range(self.num_layers):
            base = self.attention_params() + H  # + pre-MLP norm
            if self.is_moe_layer(i):
                base += self.num_experts * H + self.shared_expert_params()  # router + shared
                total += base + self.num_experts * self.expert_params()
                active += base + self.topk * self.expert_params()
            else:
                mlp = 3 * H * self.ffn_hidden_size
                total += base + mlp
                active += base + mlp
        return total, active

    def replace(self, **changes) -> "ModelConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)
