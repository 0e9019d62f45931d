"""The benchmark's reference points (``benchmarks/dispatch_bounds.py``) compute the dispatcher's job:
the bounds that carry the probabilities give bitwise the token and probability gradients of
folding's all-to-all dispatcher on the same data, at EP4, so their times bound the same work."""

import pytest
import torch
import torch.distributed as dist

from benchmarks.dispatch_bounds import bound_variants
from folding.interop.megatron.stages import MegatronDispatcher
from folding.moe.dispatch.base import TokenDispatcher
from folding.moe.dispatch.build import build_dispatcher
from folding.moe.routing.functions import topk_routing
from folding.parallel import ParallelLayout, build_parallel_state

T, H, E, K = 64, 32, 16, 2


def _job(d, x0, routing_map, probs0, g):
    """The benchmark's job through a dispatcher; returns the leaves' gradients."""
    x, probs = x0.clone().requires_grad_(), probs0.clone().requires_grad_()
    d = MegatronDispatcher(d) if isinstance(d, TokenDispatcher) else d  # the engine's, behind the six stages
    h, p = d.dispatch_preprocess(x, routing_map, probs)
    rows, _, rp = d.dispatch_postprocess(*d.token_dispatch(h, p))
    y = d.combine_postprocess(d.token_combine(d.combine_preprocess(rows * 1.5 + rp.unsqueeze(-1))))
    (y * g).sum().backward()
    return x.grad, probs.grad


def _compare_bounds():
    with build_parallel_state(ParallelLayout(world_size=4, ep=4, etp=1)) as ps:
        d = build_dispatcher("alltoall", num_experts=E, topk=K, ep_group=ps.groups.ep, etp_group=ps.groups.etp)
        gen = torch.Generator().manual_seed(ps.rank)
        x = torch.randn(T, H, generator=gen)
        probs, routing_map = topk_routing(torch.randn(T, E, generator=gen), topk=K)
        g = torch.randn(T, H, generator=gen)
        stages = MegatronDispatcher(d)  # keeps its latest call's record
        want = _job(stages, x, routing_map, probs, g)
        leaves = []
        for _, run in bound_variants(
            x, routing_map, probs, g, group=ps.groups.ep, plan=stages._record.plan, leaves=leaves
        ):
            run()
        out = {}
        for name, tensors in leaves:
            got = [t.grad for t in tensors]
            out[name] = [torch.equal(a, b) for a, b in zip(got, want)] if len(got) == 2 else None
            out[name + "_nonzero"] = bool(got[0].abs().sum() > 0)
        dist.barrier()
        return out


@pytest.mark.timeout(120)
def test_bounds_compute_the_dispatchers_job(ranks):
    for r in ranks(4).run(_compare_bounds):
        for name in ("bound_probs", "bound_counts", "bound_packed"):
            assert r[name] == [True, True], (name, r)
        assert all(r[n + "_nonzero"] for n in ("bound_move", "bound_sort", "bound_probs")), r
