"""Optimizer and learning-rate settings (Hydra keys ``optim.*``), validated when built.

Usage::

    cfg = OptimConfig(lr=3e-4, min_lr=3e-5, warmup_steps=100, decay_style="cosine",
                      weight_decay=0.1, clip_grad=1.0, distributed=True)
    cfg.validate(train_steps=1000)     # also checks the horizon against train.steps

Every bad value raises :class:`OptimConfigError` naming ``optim.<field>`` and a fix.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from .precision import MASTER_DTYPES, STATE_DTYPES

OPTIMIZERS = ("adamw", "muon")
"""Names accepted by ``optim.name``."""
DECAY_STYLES = ("constant", "cosine", "linear", "wsd")
WSD_DECAY_SHAPES = ("linear", "cosine", "sqrt")


class OptimConfigError(ValueError):
    """An ``optim.*`` setting is invalid; the message names the setting and a fix."""


@dataclasses.dataclass(kw_only=True)
class OptimConfig:
    """AdamW / Muon, gradient clipping, LR schedule and distributed-optimizer settings."""

    name: str = "adamw"
    """The optimizer: ``adamw``, or ``muon`` (Newton–Schulz orthogonalized momentum for the hidden
    weight matrices, AdamW with the settings below for embeddings, output layer, norms, biases and
    router; docs/optimizer.md, "Muon")."""
    lr: float = 3e-4
    """Peak learning rate, reached at the end of warmup."""
    min_lr: float = 0.0
    """Final learning rate at the end of the decay horizon (and after it)."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to ``lr`` (step ``k`` of warmup uses ``lr*(k+1)/warmup_steps``)."""
    decay_steps: Optional[int] = None
    """Horizon of the schedule in optimizer steps, warmup included; ``None`` means ``train.steps``.
    The LR at step ``k`` depends only on ``k`` and this horizon, never on how long a run lasts."""
    decay_style: str = "cosine"
    """After warmup: ``constant`` (stay at ``lr``), ``cosine`` or ``linear`` (from ``lr`` to ``min_lr``
    at ``decay_steps``), or ``wsd`` (warmup-stable-decay: ``lr`` until the last ``wsd_decay_fraction``
    of the horizon, then down to ``min_lr``)."""
    wsd_decay_fraction: float = 0.1
    """Fraction of the horizon ``decay_steps`` spent decaying under ``decay_style=wsd``."""
    wsd_decay_shape: str = "linear"
    """Shape of the WSD decay phase: ``linear``, ``cosine`` or ``sqrt`` (1 - sqrt(progress))."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay; not applied to norms, biases or router biases (see docs)."""
    clip_grad: Optional[float] = 1.0
    """Clip the global gradient norm to this value; ``0`` or ``None`` disables clipping."""
    distributed: bool = False
    """ZeRO-1: shard AdamW state and fp32 master weights over DP×CP (dense) and EDP (experts)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    bucket_size: int = 40_000_000
    """Elements per gradient-reduction bucket (the unit of communication and of overlap)."""
    overlap_grad_reduce: bool = True
    """Launch each bucket's reduction from backward hooks as soon as its gradients are complete."""
    exp_avg_dtype: str = "fp32"
    """Storage of AdamW's first moment: ``fp32``, ``bf16`` (round to nearest even) or ``fp8``
    (e4m3 with one fp32 scale per 128 consecutive elements of a bucket shard)."""
    exp_avg_sq_dtype: str = "fp32"
    """Storage of AdamW's second moment: ``fp32``, ``bf16`` or ``fp8`` (e4m3 of ``sqrt(v)`` with one
    fp32 scale per 128 elements: the square root halves v's exponent range)."""
    main_params_dtype: str = "fp32"
    """Weights AdamW updates for bf16 parameters: ``fp32`` (an fp32 master copy) or ``bf16`` (no copy:
    the bf16 parameter is updated in place with stochastic rounding). fp32 parameters are always their
    own fp32 master."""
    main_grads_dtype: str = "fp32"
    """Dtype gradients accumulate, reduce and feed AdamW in: ``fp32`` or ``bf16``."""
    muon_momentum: float = 0.95
    """Muon's momentum ``μ`` (``m = μ·m + g``), in [0, 1)."""
    muon_nesterov: bool = True
    """Muon orthogonalizes ``g + μ·m`` (Nesterov) instead of ``m``."""
    muon_ns_steps: int = 5
    """Newton–Schulz iterations per Muon update (quintic, coefficients 3.4445, -4.7750, 2.0315)."""
    muon_update_scale: float = 0.2
    """Muon's update is the orthogonalized matrix times ``muon_update_scale · sqrt(max(rows, cols))``
    (Moonlight: 0.2 matches the RMS of an AdamW update, so ``lr`` and ``weight_decay`` carry over)."""

    def __post_init__(self):
        self.validate()

    def validate(self, train_steps: Optional[int] = None) -> "OptimConfig":
        """Check every field (and ``decay_steps`` against ``train_steps`` when given); return self."""

        def bad(field, msg):
            raise OptimConfigError(f"optim.{field}={getattr(self, field)!r}: {msg}")

        for f in ("lr", "min_lr", "weight_decay", "eps", "wsd_decay_fraction", "beta1", "beta2"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(f, "must be a finite number")
        if self.lr < 0:
            bad("lr", "must be >= 0; use a positive peak learning rate such as 3e-4")
        if self.min_lr < 0:
            bad("min_lr", "must be >= 0")
        if self.min_lr > self.lr:
            bad("min_lr", f"is larger than optim.lr={self.lr}; set min_lr <= lr (e.g. lr/10)")
        if self.weight_decay < 0:
            bad("weight_decay", "must be >= 0")
        if self.eps <= 0:
            bad("eps", "must be > 0 (e.g. 1e-8)")
        for f in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, f) < 1.0:
                bad(f, "must be in [0, 1) (e.g. beta1=0.9, beta2=0.95)")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            bad("warmup_steps", "must be an integer >= 0")
        if self.decay_steps is not None:
            if isinstance(self.decay_steps, bool) or not isinstance(self.decay_steps, int) or self.decay_steps < 1:
                bad("decay_steps", "must be an integer >= 1, or null to use train.steps")
        if self.decay_style not in DECAY_STYLES:
            bad("decay_style", f"must be one of {', '.join(DECAY_STYLES)}")
        if self.wsd_decay_shape not in WSD_DECAY_SHAPES:
            bad("wsd_decay_shape", f"must be one of {', '.join(WSD_DECAY_SHAPES)}")
        if not 0.0 <= self.wsd_decay_fraction <= 1.0:
            bad("wsd_decay_fraction", "must be in [0, 1] (e.g. 0.1 for the last 10% of the horizon)")
        if self.clip_grad is not None and (
            isinstance(self.clip_grad, bool) or self.clip_grad < 0 or not math.isfinite(self.clip_grad)
        ):
            bad("clip_grad", "must be >= 0 (0 or null disables clipping)")
        if isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int) or self.bucket_size < 1:
            bad("bucket_size", "must be an integer >= 1 (elements per bucket, e.g. 40000000)")
        for f, names in (
            ("exp_avg_dtype", STATE_DTYPES),
            ("exp_avg_sq_dtype", STATE_DTYPES),
            ("main_params_dtype", MASTER_DTYPES),
            ("main_grads_dtype", MASTER_DTYPES),
        ):
            if getattr(self, f) not in names:
                bad(f, f"must be one of {', '.join(names)}")
        if self.name not in OPTIMIZERS:
            bad("name", f"must be one of {', '.join(OPTIMIZERS)} (adamw is the default)")
        m = self.muon_momentum
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m < 1.0:
            bad("muon_momentum", "must be a number in [0, 1) (e.g. 0.95)")
        if not isinstance(self.muon_nesterov, bool):
            bad("muon_nesterov", "must be true or false")
        n = self.muon_ns_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            bad("muon_ns_steps", "must be an integer >= 1 (5 is the tuned value of the quintic iteration)")
        s = self.muon_update_scale
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
            bad("muon_update_scale", "must be a finite number > 0 (0.2 matches AdamW's update RMS)")
        if train_steps is not None and self.decay_steps is None and train_steps < 1:
            raise OptimConfigError(f"optim.decay_steps=None uses train.steps={train_steps}, which must be >= 1")
        horizon = self.decay_steps if self.decay_steps is not None else train_steps
        if horizon is not None and self.decay_style != "constant" and self.warmup_steps > horizon:
            bad(
                "warmup_steps",
                f"exceeds the decay horizon ({horizon} steps); lower warmup_steps or raise optim.decay_steps",
            )
        return self

    def fused(self) -> bool:
        """Whether every state is fp32, so that PyTorch's fused AdamW kernel runs the update."""
        return all(
            getattr(self, f) == "fp32"
            for f in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype", "main_grads_dtype")
        )

    def horizon(self, train_steps: Optional[int]) -> int:
        """The schedule horizon: ``decay_steps``, or ``train_steps`` when it is ``None``."""
        if self.decay_steps is not None:
            return self.decay_steps
        if train_steps is None:
            raise OptimConfigError("optim.decay_steps=None needs train.steps; set optim.decay_steps explicitly")
        return train_steps
