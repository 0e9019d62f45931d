"""Global gradient norm and clipping over folded layouts: every parameter counted exactly once.

After reduction, a buffer's gradient is identical on every rank of its data-parallel group; each
rank adds only its shard of every bucket (so DP×CP / EDP replicas split the work and count once).
Across tensor parallelism, TP-sharded parameters count on every rank (each holds a different shard)
while TP-replicated and sequence-parallel ones count on TP rank 0 only (ETP rank 0 for experts).
Expert parameters differ across EP and (when sharded) ETP, and are replicated over EDP only; tied
embeddings count on the first pipeline stage only. The per-rank sums of squares are then summed
over the whole world (one scalar all-reduce), which covers PP, EP and every data-parallel group.

Usage::

    norm = global_grad_norm(buffers, world_group=None)
    clip_coefficient(norm, max_norm=1.0)      # <= 1.0
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.distributed as dist

from .grad_buffer import GradBuffer


def local_sum_of_squares(buffers: List[GradBuffer]) -> torch.Tensor:
    """This rank's share of the squared global grad norm (float64 scalar on the buffers' device;
    no host synchronization)."""
    dev = buffers[0].main_grad.device if buffers else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=dev)
    for buf in buffers:
        if not buf.groups.counts_in_norm:
            continue
        for b in buf.buckets:
            lo, hi = buf.shard_range(b)
            g = buf.main_grad[lo:hi].float()  # bf16 main grads: square and sum in fp32
            total += torch.dot(g, g).double()
    return total


def global_grad_norm(buffers: List[GradBuffer], *, world_group: Optional[dist.ProcessGroup] = None) -> float:
    """The L2 norm of the whole model's gradient (all-reduce of one scalar over ``world_group``,
    the world by default; call on every rank). NaN/Inf anywhere gives a non-finite result."""
    sq = local_sum_of_squares(buffers)
    if dist.is_initialized() and dist.get_world_size(world_group) > 1:
        dist.all_reduce(sq, group=world_group)
    return math.sqrt(sq.item())


def clip_coefficient(norm: float, max_norm: Optional[float]) -> float:
    """The factor gradients are multiplied by: ``max_norm/(norm+1e-6)`` when that is < 1, else 1."""
    if not max_norm:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
