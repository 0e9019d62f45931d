"""Both dispatchers on 1, 2, 4 and 8 gloo ranks against a single-process reference.

Each rank holds a distinct chunk of one global token set (as attention ranks do under folding),
routes it with a random map, runs a toy per-expert SwiGLU-like function on the rows it receives
(its EP slice of the experts, its ETP slice of F) and combines. The reference computes, in one
process, ``y_t = Σ_{e kept for t} (silu(x_t A_e) · p_te) B_e`` on all tokens; outputs and gradients
of tokens, probabilities and expert weights must match (fp64, so to round-off). Weight gradients
are summed over EDP replicas before comparing, as the optimizer would.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from folding.moe import host_sync
from folding.moe.dispatcher import build_dispatcher
from folding.moe.permute import padded_rows_per_expert
from folding.parallel import ParallelLayout, build_parallel_state

H, FF, T = 8, 6, 6


def _problem(world, E, topk, mode, seed, cf):
    """Global inputs; the routing map is built per rank chunk (dropping decided from local tokens)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world * T, H, generator=g, dtype=torch.float64)
    scores = torch.rand(world * T, E, generator=g, dtype=torch.float64)
    top = scores.topk(topk, dim=1).indices
    rmap = torch.zeros(world * T, E, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.where(rmap, scores, torch.zeros_like(scores))
    if mode != "dropless":  # keep at most `capacity` earliest tokens per expert inside each rank chunk
        cap = padded_rows_per_expert(T, topk, E, cf) if mode == "pad" else int(-(-T * topk * cf // E))
        for r in range(world):
            blk = rmap[r * T:(r + 1) * T]
            keep = (blk.cumsum(0) <= cap) & blk
            rmap[r * T:(r + 1) * T] = keep
        dropped = (probs != 0) & ~rmap
        assert mode == "pad" or dropped.any(), "the case should drop something"
    A = torch.randn(E, H, FF, generator=g, dtype=torch.float64)
    B = torch.randn(E, FF, H, generator=g, dtype=torch.float64)
    gy = torch.randn(world * T, H, generator=g, dtype=torch.float64)
    return x, rmap, probs, A, B, gy


def _reference(x, rmap, probs, A, B, gy):
    x, probs, A, B = (t.clone().requires_grad_(True) for t in (x, probs, A, B))
    y = torch.zeros_like(x)
    for e in range(A.shape[0]):
        w = (probs[:, e] * rmap[:, e]).unsqueeze(1)
        y = y + (F.silu(x @ A[e]) * w) @ B[e]
    (y * gy).sum().backward()
    return y.detach(), x.grad, probs.grad, A.grad, B.grad


def _toy_experts(tokens_NH, tpe, probs_N, A_LHF, B_LFH):
    outs, start = [], 0
    for l, n in enumerate(tpe.tolist()):
        xs, ps = tokens_NH[start:start + n], probs_N[start:start + n]
        outs.append((F.silu(xs @ A_LHF[l]) * ps.unsqueeze(1)) @ B_LFH[l])
        start += n
    return torch.cat(outs) if outs else tokens_NH[:0]


def _one_case(c, ps, world, rank):
    E, k, mode = c["E"], c["topk"], c["mode"]
    x, rmap, probs, A, B, gy = _problem(world, E, k, mode, c["seed"], c.get("cf", 1.0))
    sl = slice(rank * T, (rank + 1) * T)
    d = build_dispatcher(c["kind"], num_experts=E, topk=k, ep_group=ps.ep_group, etp_group=ps.etp_group,
                         capacity_factor=None if mode == "dropless" else c.get("cf", 1.0),
                         pad_to_capacity=mode == "pad")
    L, Fs = E // c["ep"], FF // c["etp"]
    off, j = d.local_expert_offset, ps.etp_rank
    A_l = A[off:off + L, :, j * Fs:(j + 1) * Fs].clone().requires_grad_(True)
    B_l = B[off:off + L, j * Fs:(j + 1) * Fs, :].clone().requires_grad_(True)
    xl = x[sl].clone().requires_grad_(True)
    pl = probs[sl].clone().requires_grad_(True)
    before = host_sync.count()
    shape = (T // 2, 2, H) if c.get("sbh") else (T, H)
    tokens, tpe, pn = d.dispatch(xl.view(shape), rmap[sl], pl)
    assert tpe.device.type == "cpu" and tpe.dtype == torch.long
    assert int(tpe.sum()) == tokens.shape[0]
    y = d.combine(_toy_experts(tokens, tpe, pn, A_l, B_l))
    syncs = host_sync.count() - before
    assert y.shape == shape
    (y.reshape(T, H) * gy[sl]).sum().backward()
    return dict(y=y.detach().reshape(T, H), gx=xl.grad, gp=pl.grad, gA=A_l.grad, gB=B_l.grad,
                off=off, etp_rank=j, syncs=syncs)


def _run_cases(cases):
    """Every case on this rank; one ParallelState per (ep, etp) layout."""
    world, rank = dist.get_world_size(), dist.get_rank()
    states, results = {}, []
    try:
        for c in cases:
            key = (c["ep"], c["etp"])
            if key not in states:
                states[key] = build_parallel_state(ParallelLayout(world_size=world, ep=c["ep"], etp=c["etp"]))
            results.append(_one_case(c, states[key], world, rank))
    finally:
        for ps in states.values():
            ps.destroy()
    return results


def _check(world, cases, per_rank):
    for i, c in enumerate(cases):
        x, rmap, probs, A, B, gy = _problem(world, c["E"], c["topk"], c["mode"], c["seed"], c.get("cf", 1.0))
        y, gx, gp, gA, gB = _reference(x, rmap, probs, A, B, gy)
        res = [r[i] for r in per_rank]
        tag = str(c)
        torch.testing.assert_close(torch.cat([r["y"] for r in res]), y, msg=tag)
        torch.testing.assert_close(torch.cat([r["gx"] for r in res]), gx, msg=tag)
        # a dropped pair gets no gradient; kept pairs get the reference's
        torch.testing.assert_close(torch.cat([r["gp"] for r in res]), gp * rmap, msg=tag)
        L, Fs = c["E"] // c["ep"], FF // c["etp"]
        sumA, sumB = torch.zeros_like(gA), torch.zeros_like(gB)
        for r in res:  # sum the EDP replicas' weight gradients into the full tensors
            j, off = r["etp_rank"], r["off"]
            sumA[off:off + L, :, j * Fs:(j + 1) * Fs] += r["gA"]
            sumB[off:off + L, j * Fs:(j + 1) * Fs, :] += r["gB"]
        torch.testing.assert_close(sumA, gA, msg=tag)
        torch.testing.assert_close(sumB, gB, msg=tag)
        syncs = {r["syncs"] for r in res}
        assert syncs == ({0} if c["mode"] == "pad" else {1}), (tag, syncs)


def _cases(world):
    out, seed = [], 0
    layouts = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 4: [(4, 1), (2, 2), (1, 2)], 8: [(8, 1), (2, 2), (4, 2)]}[world]
    for ep, etp in layouts:
        for kind in ("alltoall", "allgather"):
            for mode in ("dropless", "drop", "pad"):
                seed += 1
                out.append(dict(ep=ep, etp=etp, kind=kind, mode=mode, E=8 if ep != 8 else 8, topk=2, seed=seed,
                                cf=1.0 if mode == "drop" else 1.5, sbh=seed % 2 == 0))
    return out


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_dispatchers_match_reference(ranks, world):
    cases = _cases(world)
    per_rank = ranks(world).run(_run_cases, cases)
    _check(world, cases, per_rank)
