"""One AdamW update of one flat bucket shard, for every state precision.

Two paths compute the same algorithm (decoupled weight decay, bias-corrected moments):

- :func:`adamw_fused`: PyTorch's fused kernel ``torch._fused_adamw_`` (CPU and CUDA), one pass and
  no temporaries, when the weights, gradient and both moments are fp32 tensors (torch 2.13's kernel
  takes fp32 or bf16 but one dtype for all four, and rounds to nearest: it can neither mix an fp32
  master with bf16 moments nor round stochastically);
- :func:`adamw_shard`: the elementwise path for any mix of :class:`~folding.optim.precision.StateShard`
  storages: read every state to fp32, update in fp32, write each back rounded to its storage dtype
  (bf16 master weights stochastically). Per bucket shard the temporaries are a few fp32 copies.

Usage::

    adamw_shard(w, g, m, v, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1,
                generator=gen)
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .precision import StateShard

# PyTorch's fused AdamW kernel (CPU and CUDA): the same update as the elementwise path
FUSED_ADAMW = getattr(torch, "_fused_adamw_", None)


def fusable(w: StateShard, g: torch.Tensor, m: StateShard, v: StateShard) -> bool:
    """Whether :func:`adamw_fused` can run this shard (all fp32, on a device the kernel supports)."""
    return (
        FUSED_ADAMW is not None
        and g.dtype == torch.float32
        and all(s.dtype == "fp32" for s in (w, m, v))
        and w.data.device.type in ("cpu", "cuda")
    )


def adamw_fused(w, g, m, v, *, lr, beta1, beta2, eps, weight_decay, step_t: torch.Tensor) -> None:
    """PyTorch's fused AdamW on fp32 shards (``step_t``: the update count as a tensor on the device)."""
    FUSED_ADAMW(
        [w.data],
        [g],
        [m.data],
        [v.data],
        [],
        [step_t],
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=False,
        maximize=False,
    )


def adamw_shard(
    w: StateShard,
    g: torch.Tensor,
    m: StateShard,
    v: StateShard,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    generator: Optional[torch.Generator] = None,
) -> None:
    """AdamW on one shard in fp32 arithmetic, each state stored back in its own dtype:
    ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``, ``w = w (1 - lr wd) - lr/bc1 * m /
    (sqrt(v)/sqrt(bc2) + eps)`` with ``bc_i = 1 - b_i^step`` (as torch's AdamW).
    ``generator`` feeds stochastic rounding of bf16 master weights."""
    g32 = g.float()
    # read() returns the fp32 storage itself or a fresh fp32 copy: in-place arithmetic is safe
    m32, v32, w32 = m.read(), v.read(), w.read()
    m32.lerp_(g32, 1.0 - beta1)
    v32.mul_(beta2).addcmul_(g32, g32, value=1.0 - beta2)
    if weight_decay:
        w32.mul_(1.0 - lr * weight_decay)
    bc1 = 1.0 - beta1**step
    bc2 = 1.0 - beta2**step
    denom = v32.sqrt().div_(math.sqrt(bc2)).add_(eps)
    w32.addcdiv_(m32, denom, value=-lr / bc1)
    m.write(m32)
    v.write(v32)
    w.write(w32, generator)
