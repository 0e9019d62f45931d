"""RMSNorm, computed in fp32 like Hugging Face's norms, replicated or with its features sharded over TP.

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

import torch
from torch import nn

from ..parallel.collectives import all_reduce, group_rank, group_size
from ..parallel.params import mark_param, set_init_spec


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
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


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
        dtype = x.dtype
        x32 = x.float()
        sumsq = all_reduce(x32.pow(2).sum(-1, keepdim=True), self.tp_group)
        x32 = x32 * torch.rsqrt(sumsq / self.features + self.eps)
        return self.weight * x32.to(dtype)
