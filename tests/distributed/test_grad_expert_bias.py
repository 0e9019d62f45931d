"""The batched expert-bias update (one all-reduce for all routers) equals each router's own update
and the rule applied to the counts summed over TP×DP×CP."""

import torch
import torch.distributed as dist

from folding.moe.config import MoEConfig
from folding.moe.routing.router import Router
from folding.optim.expert_bias import update_expert_biases
from folding.parallel import ParallelLayout, build_parallel_state


def _counts(rank, layer):
    # rank-dependent counts: no single rank's sign pattern equals the summed one
    g = torch.Generator().manual_seed(100 * layer + rank)
    return torch.randint(0, 10, (4,), generator=g).float()


def _update(layout_kwargs):
    ps = build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), **layout_kwargs))
    try:
        cfg = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=8, expert_bias=True, expert_bias_update_rate=0.5)

        def make():
            rs = [
                Router(
                    hidden_size=8,
                    config=cfg,
                    groups=ps.groups,
                    init_seed=0,
                    layer_number=i,
                )
                for i in range(2)
            ]
            for i, r in enumerate(rs):
                r.local_tokens_per_expert.copy_(_counts(dist.get_rank(), i).to(r.local_tokens_per_expert.dtype))
            return rs

        routers, own = make(), make()
        update_expert_biases(routers, group=ps.groups.tp_dp_cp)
        for r in own:  # one all-reduce per router
            update_expert_biases([r], group=ps.groups.tp_dp_cp)
        return (
            [r.expert_bias.tolist() for r in routers],
            [r.expert_bias.tolist() for r in own],
            [r.local_tokens_per_expert.sum().item() for r in routers],
            ps.coords.tp_dp_cp.ranks,
        )
    finally:
        ps.destroy()


def test_expert_bias_update(ranks):
    out = ranks(4).run(_update, dict(tp=2, pp=2, ep=2, etp=1))  # TP×DP×CP groups of 2 ranks per stage
    for rank, (batched, own, counts_left, group) in enumerate(out):
        assert len(group) == 2 and counts_left == [0.0, 0.0]
        assert batched == own, rank
        for layer in range(2):
            total = sum(_counts(r, layer) for r in group)
            assert batched[layer] == (0.5 * torch.sign(total.mean() - total)).tolist(), (rank, layer)
