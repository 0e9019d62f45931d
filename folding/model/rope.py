"""Rotary position embeddings (the "rotate half" convention of Hugging Face Llama/Mixtral/Qwen2).

Positions are explicit, so context-parallel ranks (which hold non-contiguous, load-balanced chunks)
rotate their tokens by their true positions.

Usage::

    cos_SD, sin_SD = rope_cos_sin(positions_S, head_dim, theta=1e6)
    q_SBND = apply_rope(q_SBND, cos_SD, sin_SD)
"""

from __future__ import annotations

from typing import Tuple

import torch


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin`` of shape ``[S, head_dim]`` for integer ``positions [S]``."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim)
    )
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_SBAD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [S, B, heads, D]`` by the angles of its positions (``cos/sin [S, D]``)."""
    cos = cos_SD[:, None, None, :].to(x_SBAD.dtype)
    sin = sin_SD[:, None, None, :].to(x_SBAD.dtype)
    return x_SBAD * cos + _rotate_half(x_SBAD) * sin
