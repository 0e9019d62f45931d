"""The sequence-parallel all-gather fused with column-parallel linears, on 4 gloo ranks (TP2 and TP4).

Every rank holds one sequence shard of the same full input ``x [S, B, H]`` and one row shard of two
weights (one with a bias). Outputs and the gradients of ``x``, the weights and the bias must equal the
slices of plain autograd on the full tensors, computed in each rank. The fused op must keep only the
shard for backward; the unfused path (all-gather, then ``F.linear``) keeps the gathered input, which
shows that the check can fail. With ``delay_wgrad`` (``parallel.delay_wgrad``) the weight and bias
gradients come later (none yet when the input's gradient is ready: deferred onto the overlap runtime
current in the forward) and bitwise equal.
"""

import torch
import torch.nn.functional as F

from folding.overlap.runtime import OverlapRuntime
from folding.parallel import ParallelLayout, build_parallel_state
from folding.parallel.collectives import gather_from_sequence_region, group_rank, group_size
from folding.parallel.sequence_parallel import gather_linears

S, B, H, OUT1, OUT2 = 8, 2, 6, 12, 4


def _saved_shapes(fn):
    shapes = []

    def pack(t):
        shapes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, shapes


def _case(tp: int):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(5)
    x_full = torch.randn(S, B, H, generator=g)
    w1, b1, w2 = torch.randn(OUT1, H, generator=g), torch.randn(OUT1, generator=g), torch.randn(OUT2, H, generator=g)
    cot1, cot2 = torch.randn(S, B, OUT1, generator=g), torch.randn(S, B, OUT2, generator=g)

    ref = [t.clone().requires_grad_() for t in (x_full, w1, b1, w2)]
    r1, r2 = F.linear(ref[0], ref[1], ref[2]), F.linear(ref[0], ref[3])
    ((r1 * cot1).sum() + (r2 * cot2).sum()).backward()

    with build_parallel_state(ParallelLayout(world_size=4, tp=tp)) as ps:
        grp = ps.groups.tp
        n, r = group_size(grp), group_rank(grp)
        rows = lambda t: t.chunk(n, dim=0)[r].clone().requires_grad_()  # noqa: E731
        x, lw1, lb1, lw2 = rows(x_full), rows(w1), rows(b1), rows(w2)
        cols = lambda t: t.chunk(n, dim=-1)[r]  # noqa: E731
        (y1, y2), saved = _saved_shapes(lambda: gather_linears(x, [lw1, lw2], [lb1, None], grp))
        ((y1 * cols(cot1)).sum() + (y2 * cols(cot2)).sum()).backward()
        _, saved_unfused = _saved_shapes(
            lambda: F.linear(gather_from_sequence_region(x.detach(), grp), lw1.detach().requires_grad_())
        )
        # the same with the weight gradients deferred: delivered by the end of the backward, bitwise
        dx, dw1, db1, dw2 = (t.detach().clone().requires_grad_() for t in (x, lw1, lb1, lw2))
        with OverlapRuntime().active():  # outside every runtime deferred work would run at once
            d1, d2 = gather_linears(dx, [dw1, dw2], [db1, None], grp, delay_wgrad=True)
            pending = []
            dx.register_hook(lambda g: pending.append((dw1.grad, db1.grad, dw2.grad)))
            ((d1 * cols(cot1)).sum() + (d2 * cols(cot2)).sum()).backward()
        deferred = dict(
            out=torch.equal(d1, y1) and torch.equal(d2, y2),
            grads=[torch.equal(a.grad, b.grad) for a, b in ((dx, x), (dw1, lw1), (db1, lb1), (dw2, lw2))],
            pending=pending,
        )
    return dict(
        out=(y1.detach(), cols(r1.detach()), y2.detach(), cols(r2.detach())),
        grads=[
            (x.grad, rows(ref[0].grad)),
            (lw1.grad, rows(ref[1].grad)),
            (lb1.grad, rows(ref[2].grad)),
            (lw2.grad, rows(ref[3].grad)),
        ],
        saved=saved,
        saved_unfused=saved_unfused,
        shard=tuple(x.shape),
        shard_numel=x.numel(),
        deferred=deferred,
    )


def test_gather_linears_match_one_rank_and_keep_only_the_shard(ranks):
    for tp in (2, 4):
        for res in ranks(4).run(_case, tp):
            y1, want1, y2, want2 = res["out"]
            assert torch.allclose(y1, want1, atol=1e-5) and torch.allclose(y2, want2, atol=1e-5), tp
            for got, want in res["grads"]:
                assert got is not None and torch.allclose(got, want.detach(), atol=1e-5), (tp, got, want)
            assert res["shard"] == (S // tp, B, H)
            # sizes (numel) of the tensors autograd keeps: the shard and the weights, never the gathered input
            assert res["shard_numel"] in res["saved"], res["saved"]
            assert S * B * H not in res["saved"], f"fused op kept the gathered input: {res['saved']}"
            assert S * B * H in res["saved_unfused"], res["saved_unfused"]
            d = res["deferred"]
            assert d["out"] and d["grads"] == [True] * 4, (tp, d)
            assert d["pending"] == [(None, None, None)], "the weight gradients were not deferred"
