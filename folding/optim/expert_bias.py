"""Aux-loss-free load balancing: every router's expert-bias update in one collective per step.

Each MoE :class:`~folding.moe.router.Router` with ``moe.expert_bias`` keeps an fp32 ``expert_bias``
buffer (no gradient, no weight decay) used for expert *selection* only, and counts the tokens it
routed to each expert during the step (``local_tokens_per_expert``). Once per global batch, after
the last micro-batch's backward, the counts are summed over the attention ``TP×DP×CP`` group (every
rank of a pipeline stage holds distinct tokens) and each bias moves by
:func:`folding.moe.routing.updated_expert_bias`. :func:`update_expert_biases` concatenates every
layer's counts, so a whole stage needs a single all-reduce.

Usage::

    update_expert_biases(routers, group=ps.tp_dp_cp_group)    # once per step, every rank of the stage
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from folding.moe.routing import updated_expert_bias


def update_expert_biases(routers: Sequence, *, group) -> None:
    """Update the ``expert_bias`` of every router in ``routers`` and zero their token counts.

    Collective: one all-reduce (sum, float64, no autograd) of the concatenated
    ``local_tokens_per_expert`` over ``group`` (the attention ``tp_dp_cp`` group). Routers without an
    expert bias are rejected before any communication. Each router moves by its own
    ``config.expert_bias_update_rate``.
    """
    routers = list(routers)
    for r in routers:
        if getattr(r, "expert_bias", None) is None:
            raise ValueError(
                f"router of layer {getattr(r, 'layer_number', '?')} has no expert bias: set "
                "moe.expert_bias=true or leave it out of update_expert_biases()"
            )
    if not routers:
        return
    flat = torch.cat([r.local_tokens_per_expert.detach().to(torch.float64).reshape(-1) for r in routers])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    pos = 0
    with torch.no_grad():
        for r in routers:
            n = r.local_tokens_per_expert.numel()
            r.expert_bias.copy_(
                updated_expert_bias(r.expert_bias, flat[pos : pos + n], rate=r.config.expert_bias_update_rate)
            )
            r.local_tokens_per_expert.zero_()
            pos += n
