"""YaRN RoPE scaling (DeepSeek-V3's long-context RoPE) and the one entry point for a model's cos/sin.

YaRN ("Yet another RoPE extensioN", arXiv 2309.00071) blends, per frequency, the original inverse
frequency (extrapolation, for the fast-rotating dimensions) with the frequency divided by ``factor``
(interpolation, for the slow ones), with a linear ramp between the dimensions that make
``beta_fast`` and ``beta_slow`` rotations over ``original_max_position_embeddings`` positions. The
cos/sin tables are multiplied by an *attention factor* (by default
``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``, where
``mscale(s, m) = 0.1·m·ln(s) + 1`` for ``s > 1`` and 1 otherwise); multi-head latent attention also
multiplies its softmax scale by ``mscale(factor, mscale_all_dim)²`` (:func:`yarn_softmax_scale`).
These are the formulas of Hugging Face's ``rope_type: yarn`` for DeepSeek-V3.

Usage::

    yarn = YarnConfig(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)
    cos_SD, sin_SD = model_rope_cos_sin(positions_S, cfg)     # default RoPE or YaRN, the model's rope width
    scale = yarn_softmax_scale(1 / math.sqrt(192), yarn)
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .rope import rope_cos_sin
from .yarn_config import YarnConfig


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """``0.1·m·ln(scale) + 1`` for ``scale > 1``, else 1 (YaRN's magnitude correction)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_attention_factor(y: YarnConfig) -> float:
    """The multiplier of the cos/sin tables."""
    if y.attention_factor is not None:
        return float(y.attention_factor)
    if y.mscale and y.mscale_all_dim:
        return float(yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim))
    return yarn_mscale(y.factor)


def yarn_softmax_scale(scale: float, y: Optional[YarnConfig]) -> float:
    """``scale`` times ``mscale(factor, mscale_all_dim)²`` when YaRN sets ``mscale_all_dim``."""
    if y is None or not y.mscale_all_dim:
        return scale
    m = yarn_mscale(y.factor, y.mscale_all_dim)
    return scale * m * m


def yarn_inv_freq(dim: int, theta: float, y: YarnConfig, device=None) -> torch.Tensor:
    """fp32 inverse frequencies ``[dim/2]`` of YaRN for a rotary width ``dim``."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (y.factor * pos_freqs)
    keep = 1 - ramp  # 1: the original frequency, 0: interpolated
    return interpolation * (1 - keep) + extrapolation * keep


def yarn_cos_sin(positions: torch.Tensor, dim: int, theta: float, y: YarnConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin [S, dim]`` of YaRN at integer ``positions [S]`` ("rotate half" layout)."""
    if dim % 2:
        raise ValueError(f"RoPE needs an even rotary dimension, got {dim}")
    inv_freq = yarn_inv_freq(dim, theta, y, positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    a = yarn_attention_factor(y)
    return emb.cos() * a, emb.sin() * a


def model_rope_cos_sin(positions: torch.Tensor, config) -> Tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin tables of a :class:`~folding.model.config.ModelConfig` at ``positions``: the
    rotary width is ``mla.qk_rope_head_dim`` under multi-head latent attention, else the head width;
    YaRN when ``config.yarn`` is set, else default RoPE."""
    dim = config.mla.qk_rope_head_dim if config.mla is not None else config.kv_channels
    if config.yarn is not None:
        return yarn_cos_sin(positions, dim, config.rope_theta, config.yarn)
    return rope_cos_sin(positions, dim, config.rope_theta)
