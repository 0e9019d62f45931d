"""Aux-loss-free load balancing: the per-expert router bias update, once per global batch.

Each MoE router keeps an fp32 bias ``bias_E`` (a buffer, not a parameter: it has no gradient and
no weight decay) added to the scores for expert *selection* only, and counts the tokens routed to
each expert during the step's micro-batches (``counts_E``, local to the rank). After the last
micro-batch of a global batch, the counts are summed over the attention ``TP×DP×CP`` group (every
rank of the pipeline stage holds distinct tokens) and ``bias += rate * sign(mean(count) - count)``:
overloaded experts become less attractive, underloaded ones more. All layers' counts travel in one
all-reduce.

Usage::

    update_expert_biases([(router.expert_bias, router.token_counts) for router in routers],
                         rate=1e-3, group=ps.tp_dp_cp_group)     # also zeroes the counts
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist


def update_expert_biases(pairs: List[Tuple[torch.Tensor, torch.Tensor]], *, rate: float, group) -> None:
    """Update every ``(bias_E, counts_E)`` pair in place and zero the counts (collective on ``group``).

    Collective: one all-reduce (sum) of the concatenated counts over ``group`` (the attention
    ``tp_dp_cp`` group); no autograd. Call on every rank of the group, once per global batch.
    """
    if rate < 0:
        raise ValueError(f"expert-bias update rate={rate} must be >= 0")
    if not pairs:
        return
    for bias, counts in pairs:
        if bias.shape != counts.shape or bias.dim() != 1:
            raise ValueError(f"expert bias {tuple(bias.shape)} and token counts {tuple(counts.shape)} must both "
                             "be [num_experts]")
    flat = torch.cat([c.detach().to(torch.float64).reshape(-1) for _, c in pairs])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    pos = 0
    for bias, counts in pairs:
        n = counts.numel()
        total = flat[pos:pos + n]
        pos += n
        with torch.no_grad():
            bias.add_(rate * torch.sign(total.mean() - total).to(bias.dtype))
            counts.zero_()
