"""Aux-loss-free load balancing: every router's expert-bias update in one collective per step.

Each MoE router with ``moe.expert_bias`` (a :class:`~folding.moe.routing.balancing.BalancingRouter` whose
``has_expert_bias`` is true) keeps an fp32 ``expert_bias`` buffer (no gradient, no weight decay) used
for expert *selection* only, and counts the tokens it routed to each expert during the step
(``expert_demand()``). Once per global batch, after the last micro-batch's backward, the counts are
summed over the attention ``TP×DP×CP`` group (every rank of a pipeline stage holds distinct tokens)
and each router moves its bias (``update_expert_bias``: :func:`folding.moe.routing.functions.updated_expert_bias`).
:func:`update_expert_biases` concatenates every layer's counts, so a whole stage needs a single
all-reduce.

Usage::

    update_expert_biases(routers, group=ps.groups.tp_dp_cp)    # once per step, every rank of the stage
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from folding.moe.routing.balancing import BalancingRouter


def update_expert_biases(routers: Sequence[BalancingRouter], *, group) -> None:
    """Update the expert bias of every router in ``routers`` and zero their token counts.

    Collective: one all-reduce (sum, float64, no autograd) of the concatenated ``expert_demand()``
    over ``group`` (the attention ``tp_dp_cp`` group). Routers without an expert bias are rejected
    before any communication. Each router moves by its own rate (``moe.expert_bias_update_rate``).
    """
    routers = list(routers)
    for r in routers:
        if not r.has_expert_bias:
            raise ValueError(
                f"router of layer {r.layer_number} has no expert bias: set "
                "moe.expert_bias=true or leave it out of update_expert_biases()"
            )
    if not routers:
        return
    demands = [r.expert_demand() for r in routers]
    flat = torch.cat([d.detach().to(torch.float64).reshape(-1) for d in demands])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    pos = 0
    for r, d in zip(routers, demands):
        r.update_expert_bias(flat[pos : pos + d.numel()])
        pos += d.numel()
