"""A dropless routing map that is short on one rank raises the same error on every rank of the
EP x ETP domain, at once: every rank holds every rank's counts, so none is left waiting in a
collective for the failing one (which would hang until the process-group timeout)."""

import time

import pytest
import torch
import torch.distributed as dist

from folding.moe.dispatch.build import build_dispatcher
from folding.parallel import ParallelLayout, build_parallel_state

T, H, E, K = 8, 4, 8, 2


def _dispatch_short_on_rank2(cases):
    out = []
    for kind, layout_kw in cases:
        with build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), **layout_kw)) as ps:
            d = build_dispatcher(kind, num_experts=E, topk=K, ep_group=ps.groups.ep, etp_group=ps.groups.etp)
            g = torch.Generator().manual_seed(ps.rank)
            idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices
            routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True)
            if ps.rank == 2:
                routing_map[0, idx[0, 0]] = False  # one (token, expert) pair missing
            probs = routing_map.float() / K
            t0 = time.perf_counter()
            try:
                d.dispatch(torch.randn(T, H), routing_map, probs)
                out.append((kind, None, time.perf_counter() - t0))
            except ValueError as e:
                out.append((kind, str(e), time.perf_counter() - t0))
            dist.barrier()  # every rank raised: the groups are still usable
    return out


@pytest.mark.timeout(120)
def test_short_map_on_one_rank_raises_everywhere(ranks):
    cases = [("alltoall", dict(ep=4, etp=1)), ("alltoall", dict(ep=2, etp=2)), ("allgather", dict(ep=2, etp=2))]
    results = ranks(4).run(_dispatch_short_on_rank2, cases)
    for i, (kind, _) in enumerate(cases):
        messages = {r[i][1] for r in results}
        assert len(messages) == 1 and None not in messages, messages  # the same error on all 4 ranks
        msg = messages.pop()
        assert "dropless dispatch expects exactly topk=2" in msg and f"{T * K - 1}" in msg, msg
        assert max(r[i][2] for r in results) < 1.0, [r[i][2] for r in results]
