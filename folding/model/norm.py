"""RMSNorm, computed in fp32 like Hugging Face's norms, replicated or with its features sharded over TP.

Both norms run through one autograd function (:func:`rms_norm`) that keeps for backward only the
input, in its own dtype, and one fp32 ``rstd = 1/sqrt(mean(x^2) + eps)`` per row (what
TransformerEngine's and Megatron-Core's norms keep): a bf16 layer keeps ``2`` bytes per element and
``4`` per row, not an fp32 copy of the input nor the normalized output. Backward recomputes the
normalized rows from them (``(x32 * rstd).to(dtype)``, the forward's own values).

:class:`RMSNorm`: the weight is replicated over tensor parallelism; under sequence parallelism every
TP rank sees a different token chunk (or, for Qwen3-MoE's per-head q/k norm, different heads), so
its gradient is TP-partial and is tagged ``sequence_parallel`` (summed over TP by the gradient
reducer).

:class:`ShardedRMSNorm` (OLMoE's q/k norm): the normalized vector is the output of a
column-parallel projection, of which each TP rank holds ``n/TP`` features of every token. The mean
of squares over the full ``n`` features is the TP all-reduce of each rank's per-token sum of
squares, divided by ``n``; the weight is sliced like the projection's output features (tagged
``tp_sharded``, its gradient complete on each rank).

Usage::

    norm = RMSNorm(hidden_size, eps=1e-5)
    y_SBH = norm(x_SBH)
    q_norm = ShardedRMSNorm(heads * head_dim, eps=1e-5, tp_group=ps.groups.tp)
    q_SBF = q_norm(q_SBF)          # [S, B, heads*head_dim/TP]
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..parallel.collectives import all_reduce_nograd, group_rank, group_size
from ..parallel.params import mark_param, set_init_spec


class _RMSNorm(torch.autograd.Function):
    """``weight * (x32 * rstd).to(x.dtype)`` over the last dimension; keeps ``x`` and fp32 ``rstd``.

    ``group``/``features``: the features are sharded over ``group`` (``None``: all local), and the
    per-row sum of squares is all-reduced over it (forward: sum over ``group``; backward: the per-row
    ``sum(grad * x)`` is summed over ``group`` too, since every rank's output depends on every rank's
    features)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, group, features: int):
        x32 = x.float()
        if group is None:
            ms = x32.pow(2).mean(-1, keepdim=True)
        else:
            ms = all_reduce_nograd(x32.pow(2).sum(-1, keepdim=True), group) / features
        rstd = torch.rsqrt(ms + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.group, ctx.features = group, features
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        n32 = x.float() * rstd
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (g * n32.to(x.dtype)).reshape(-1, weight.numel()).sum(0).reshape(weight.shape)
        # d/dx of x*rstd(x): rstd * (gn - n * mean(gn * n)), the mean over all features of the row
        gn32 = (g * weight).to(x.dtype).float()
        dot = (gn32 * n32).sum(-1, keepdim=True)
        if ctx.group is not None:
            dot = all_reduce_nograd(dot, ctx.group)
        grad_x = (rstd * (gn32 - n32 * (dot / ctx.features))).to(x.dtype)
        return grad_x, grad_w, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float, group=None, features: Optional[int] = None):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, computed in fp32, returned in the
    dtype of ``weight * x``. Keeps ``x`` and one fp32 value per row for backward.

    ``group``: the last dimension holds this rank's ``1/size`` share of ``features`` features (column
    sharded over TP); the mean of squares is over all of them (forward: all-reduce of the per-row sums
    over ``group``; backward: all-reduce of the per-row ``sum(grad * x)``). ``None``: unsharded."""
    if group is not None and group_size(group) == 1:
        group = None
    return _RMSNorm.apply(x, weight, eps, group, features if group is not None else x.shape[-1])


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, normalized over the last dimension in fp32."""

    def __init__(self, hidden_size: int, *, eps: float, device=None, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        mark_param(self.weight, sequence_parallel=True)
        set_init_spec(self.weight, full_shape=(hidden_size,), kind="ones")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``x`` (any leading shape, hidden last); returns ``x``'s dtype."""
        return rms_norm(x, self.weight, eps=self.eps)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over ``features`` features of which this TP rank holds the slice ``[r·n/TP, (r+1)·n/TP)``.

    ``y = weight * x / sqrt(sum_TP(sum(x^2)) / features + eps)`` in fp32. The per-token sum of squares
    goes through :func:`~folding.parallel.collectives.all_reduce` (forward: sum over TP; backward:
    sum over TP of the gradient, since every rank's output depends on every rank's features).
    """

    def __init__(
        self, features: int, *, eps: float, tp_group, name: str = "features", device=None, dtype=torch.float32
    ):
        super().__init__()
        tp, r = group_size(tp_group), group_rank(tp_group)
        if features % tp:
            raise ValueError(
                f"{name}={features} is not divisible by parallel.tp={tp}; choose parallel.tp among its divisors"
            )
        self.eps, self.features, self.tp_group = eps, features, tp_group
        self.weight = nn.Parameter(torch.ones(features // tp, device=device, dtype=dtype))
        mark_param(self.weight, tp_sharded=True)
        set_init_spec(self.weight, full_shape=(features,), shards=((0, r, tp),), kind="ones")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``x [..., features/TP]`` (this rank's features of every token); returns ``x``'s dtype."""
        return rms_norm(x, self.weight, eps=self.eps, group=self.tp_group, features=self.features)
