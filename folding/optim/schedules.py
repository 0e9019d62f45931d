"""Learning-rate schedules: a pure function of the step index and the config.

``lr_at(step, config, train_steps=...)`` is the LR of optimizer step ``step`` (0-based). Its only
inputs are the step and the config (the horizon is ``optim.decay_steps``, or ``train.steps`` when that
is ``None``), so a run resumed, extended or cut short sees the same LR at the same step.

Shape: linear warmup over ``warmup_steps`` (step ``k`` uses ``lr*(k+1)/warmup_steps``), then

- ``constant``: ``lr`` forever;
- ``cosine`` / ``linear``: from ``lr`` at the end of warmup to ``min_lr`` at ``horizon``;
- ``wsd``: ``lr`` until ``horizon*(1-wsd_decay_fraction)``, then down to ``min_lr`` at ``horizon``
  with ``wsd_decay_shape``;

and ``min_lr`` for every step at or after the horizon.

Usage::

    lr = lr_at(step, cfg, train_steps=1000)
"""

from __future__ import annotations

import math
from typing import Optional

from .config import OptimConfig


def _decay(progress: float, shape: str) -> float:
    """Fraction of (lr - min_lr) left at ``progress`` in [0, 1] of a decay phase."""
    progress = min(max(progress, 0.0), 1.0)
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if shape == "sqrt":
        return 1.0 - math.sqrt(progress)
    return 1.0 - progress


def lr_at(step: int, config: OptimConfig, *, train_steps: Optional[int] = None) -> float:
    """Learning rate of 0-based optimizer step ``step`` under ``config``.

    ``train_steps`` is only read when ``config.decay_steps`` is ``None`` (it then is the horizon).
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    c = config
    if c.warmup_steps > 0 and step < c.warmup_steps:
        return c.lr * (step + 1) / c.warmup_steps
    if c.decay_style == "constant":
        return c.lr
    horizon = c.horizon(train_steps)
    if step >= horizon:
        return c.min_lr
    if c.decay_style == "wsd":
        decay_len = c.wsd_decay_fraction * horizon
        start = max(horizon - decay_len, c.warmup_steps)
        if step < start:
            return c.lr
        frac = _decay((step - start) / max(horizon - start, 1e-12), c.wsd_decay_shape)
    else:
        span = horizon - c.warmup_steps
        frac = _decay((step - c.warmup_steps) / span if span > 0 else 1.0, c.decay_style)
    return c.min_lr + (c.lr - c.min_lr) * frac
