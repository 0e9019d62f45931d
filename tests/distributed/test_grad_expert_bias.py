"""The aux-loss-free expert-bias update sums token counts over TP×DP×CP before taking signs."""
import torch
import torch.distributed as dist

from folding.optim.expert_bias import update_expert_biases
from folding.parallel import ParallelLayout, build_parallel_state


def _counts(rank, layer):
    # rank-dependent counts: no single rank's sign pattern equals the summed one
    g = torch.Generator().manual_seed(100 * layer + rank)
    return torch.randint(0, 10, (4,), generator=g).float()


def _update(layout_kwargs):
    ps = build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), **layout_kwargs))
    try:
        pairs = [(torch.zeros(4), _counts(dist.get_rank(), layer)) for layer in range(2)]
        update_expert_biases(pairs, rate=0.5, group=ps.tp_dp_cp_group)
        return [b.tolist() for b, _ in pairs], [c.sum().item() for _, c in pairs], ps.ranks["tp_dp_cp"]
    finally:
        ps.destroy()


def test_expert_bias_update(ranks):
    layout = dict(tp=2, pp=2, ep=2, etp=1)                  # TP×DP×CP groups of 2 ranks per stage
    out = ranks(4).run(_update, layout)
    for rank, (biases, counts_left, group) in enumerate(out):
        assert len(group) == 2 and counts_left == [0.0, 0.0]
        for layer in range(2):
            total = sum(_counts(r, layer) for r in group)
            want = 0.5 * torch.sign(total.mean() - total)
            assert biases[layer] == want.tolist(), (rank, layer)
