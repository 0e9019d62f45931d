"""Typed configuration of multi-head latent attention (MLA, DeepSeek-V2/V3) and its parameter count.

MLA compresses the keys and values of every head into one latent vector per token (``kv_lora_rank``
wide, normed) plus one rotary key shared by all heads (``qk_rope_head_dim``), and optionally the
queries into a ``q_lora_rank`` latent. Per head, the query and key are ``qk_nope_head_dim`` position-free
dimensions followed by ``qk_rope_head_dim`` rotary ones; the value is ``v_head_dim`` wide. The module
is :class:`folding.model.mla.MLAttention`; ``ModelConfig.mla`` holds this record (``None``: GQA).

Usage::

    mla = MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                    v_head_dim=128)                      # DeepSeek-V3
    mla.replicated_params(hidden_size=7168) + 128 * mla.head_params(hidden_size=7168)  # one attention block
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Multi-head latent attention sizes (Hugging Face DeepSeek-V3 names)."""

    q_lora_rank: Optional[int]
    """Width of the query latent (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``); ``None``: one
    ``q_proj`` from the hidden state."""
    kv_lora_rank: int
    """Width of the compressed key/value latent (``kv_a_proj_with_mqa`` -> ``kv_a_layernorm`` -> ``kv_b_proj``)."""
    qk_nope_head_dim: int
    """Position-free query/key dimensions per head."""
    qk_rope_head_dim: int
    """Rotary query/key dimensions per head (the rotary key is shared by all heads)."""
    v_head_dim: int
    """Value dimensions per head."""
    rope_interleave: bool = True
    """The checkpoint's rotary dimensions are interleaved pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek's
    layout); they are de-interleaved before the "rotate half" RoPE, which gives the same scores."""
    latent_norm_eps: float = 1e-6
    """Epsilon of ``q_a_layernorm`` and ``kv_a_layernorm`` (Hugging Face builds them with 1e-6
    whatever ``rms_norm_eps`` is)."""

    def __post_init__(self):
        for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model.mla.{f}={v!r} must be an integer >= 1")
        q = self.q_lora_rank
        if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 1):
            raise ValueError(f"model.mla.q_lora_rank={q!r} must be an integer >= 1 or null (a plain q_proj)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model.mla.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE pairs)")

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def replicated_params(self, *, hidden_size: int) -> int:
        """Parameters of one MLA block that every tensor-parallel rank holds whole: the down-projections
        (``q_a_proj``, ``kv_a_proj_with_mqa``) and the latent norms."""
        n = hidden_size * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        if self.q_lora_rank is not None:
            n += hidden_size * self.q_lora_rank + self.q_lora_rank
        return n

    def head_params(self, *, hidden_size: int) -> int:
        """Parameters of one MLA block per attention head (split over tensor parallelism by heads): the
        head's rows of ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj`` and its columns of ``o_proj``."""
        q_in = hidden_size if self.q_lora_rank is None else self.q_lora_rank
        kv = self.kv_lora_rank * (self.qk_nope_head_dim + self.v_head_dim)
        return q_in * self.qk_head_dim + kv + self.v_head_dim * hidden_size
