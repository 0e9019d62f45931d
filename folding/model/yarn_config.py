"""Typed configuration of YaRN RoPE scaling (``ModelConfig.yarn``), apart from the tables it gives
(:mod:`folding.model.rope_yarn`, which needs torch), so that the configuration imports no torch."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnConfig:
    """YaRN RoPE scaling parameters (Hugging Face ``rope_parameters`` with ``rope_type: yarn``)."""

    factor: float
    """Context extension factor (DeepSeek-V3: 40)."""
    original_max_position_embeddings: int
    """Context length of pre-training before the extension (DeepSeek-V3: 4096)."""
    beta_fast: float = 32.0
    """Rotations above which a dimension keeps its original frequency (extrapolation)."""
    beta_slow: float = 1.0
    """Rotations below which a dimension is fully interpolated (frequency / factor)."""
    mscale: Optional[float] = None
    """Numerator coefficient of the default attention factor (``None``: 1, the plain YaRN factor)."""
    mscale_all_dim: Optional[float] = None
    """Denominator coefficient of the attention factor and the softmax-scale correction of MLA
    (``None`` or 0: no softmax-scale correction)."""
    attention_factor: Optional[float] = None
    """Multiplier of cos/sin; ``None`` derives it from ``factor``, ``mscale`` and ``mscale_all_dim``."""
    truncate: bool = True
    """Round the ramp's bounds to whole dimensions (floor / ceil)."""

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"model.yarn.factor={self.factor!r} must be > 0")
        if isinstance(self.original_max_position_embeddings, bool) or self.original_max_position_embeddings < 1:
            raise ValueError(
                f"model.yarn.original_max_position_embeddings={self.original_max_position_embeddings!r} must be >= 1"
            )
        if not self.beta_fast > self.beta_slow > 0:
            raise ValueError(
                f"model.yarn.beta_fast={self.beta_fast} and beta_slow={self.beta_slow}: need beta_fast > beta_slow > 0"
            )
