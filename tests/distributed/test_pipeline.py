"""Pipeline schedules on gloo ranks give the 1-rank losses and gradients (toy layer stack)."""

import pytest
import torch
import torch.distributed as dist

from folding.parallel import ParallelLayout, build_parallel_state
from folding.pipeline.p2p import P2P
from folding.pipeline.schedules import forward_backward

L, S, B, H = 8, 3, 2, 4


def _weights():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(H, H, generator=g, dtype=torch.float64) * 0.5 for _ in range(L)]


def _batches(M):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(S, B, H, generator=g, dtype=torch.float64) for _ in range(M)]


def reference(M):
    ws = [w.clone().requires_grad_(True) for w in _weights()]
    losses = []
    for x in _batches(M):
        for w in ws:
            x = torch.tanh(x @ w)
        loss = (x**2).sum() / M
        loss.backward()
        losses.append(loss.item())
    return losses, [w.grad for w in ws]


def _run(cases):
    out = []
    for pp, vpp, M in cases:
        layout = ParallelLayout(world_size=dist.get_world_size(), pp=pp, vpp=vpp)
        ps = build_parallel_state(layout)
        try:
            V = pp * vpp
            per = L // V
            full = _weights()
            mine = {}  # chunk -> list of (layer index, param)
            for c in range(vpp):
                v = c * pp + ps.coords.pp.rank
                mine[c] = [(i, full[i].clone().requires_grad_(True)) for i in range(v * per, (v + 1) * per)]
            batches = _batches(M)

            def step(chunk, m, inp):
                x = batches[m] if inp is None else inp
                for _, w in mine[chunk]:
                    x = torch.tanh(x @ w)
                v = chunk * pp + ps.coords.pp.rank
                return (x**2).sum() / M if v == V - 1 else x

            p2p = P2P(pp_group=ps.groups.pp, pp_ranks=ps.coords.pp.ranks, pp_rank=ps.coords.pp.rank)
            losses = forward_backward(
                forward_step=step,
                num_microbatches=M,
                pp_size=pp,
                pp_rank=ps.coords.pp.rank,
                vpp=vpp,
                p2p=p2p,
                tensor_shape=(S, B, H),
                dtype=torch.float64,
            )
            grads = {i: w.grad for c in mine for i, w in mine[c]}
            out.append(([l.item() for l in losses], grads))
        finally:
            ps.destroy()
    return out


CASES = [(1, 1, 3), (2, 1, 1), (2, 1, 5), (4, 1, 6), (2, 2, 4), (4, 2, 4), (4, 2, 8)]


def test_pipeline_matches_one_rank(ranks):
    results = ranks(4).run(_run, CASES)
    for idx, (pp, vpp, M) in enumerate(CASES):
        ref_losses, ref_grads = reference(M)
        grads = {}
        last_losses = None
        for rank_out in results:
            losses, g = rank_out[idx]
            if losses:
                last_losses = losses
            for i, gi in g.items():  # every data-parallel replica of a stage holds the same gradients
                torch.testing.assert_close(gi, ref_grads[i], rtol=1e-12, atol=1e-12)
            grads.update(g)
        assert last_losses == pytest.approx(ref_losses, rel=1e-12), (pp, vpp, M)
        assert sorted(grads) == list(range(L))
        for i in range(L):
            torch.testing.assert_close(grads[i], ref_grads[i], rtol=1e-12, atol=1e-12)
