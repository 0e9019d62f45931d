"""RMSNorm, computed in fp32 like Hugging Face's Mixtral / Qwen2-MoE norms.

The weight is replicated over tensor parallelism; under sequence parallelism every TP rank sees a
different token chunk, so its gradient is TP-partial and is tagged ``sequence_parallel`` (summed
over TP by the gradient reducer).

Usage::

    norm = RMSNorm(hidden_size, eps=1e-5)
    y_SBH = norm(x_SBH)
"""

from __future__ import annotations

import torch
from torch import nn

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
