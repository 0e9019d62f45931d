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

from folding.moe.dispatch import host_sync
from folding.moe.dispatch.build import build_dispatcher
from folding.moe.dispatch.permute import padded_rows_per_expert
from folding.moe.routing.functions import expert_capacity
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
        cap = (
            padded_rows_per_expert(T, topk, E, cf)
            if mode == "pad"
            else expert_capacity(T, topk=topk, num_experts=E, capacity_factor=cf)
        )
        for r in range(world):
            blk = rmap[r * T : (r + 1) * T]
            keep = (blk.cumsum(0) <= cap) & blk
            rmap[r * T : (r + 1) * T] = keep
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
        xs, ps = tokens_NH[start : start + n], probs_N[start : start + n]
        outs.append((F.silu(xs @ A_LHF[l]) * ps.unsqueeze(1)) @ B_LFH[l])
        start += n
    return torch.cat(outs) if outs else tokens_NH[:0]


def _one_case(c, ps, world, rank):
    E, k, mode = c["E"], c["topk"], c["mode"]
    x, rmap, probs, A, B, gy = _problem(world, E, k, mode, c["seed"], c.get("cf", 1.0))
    sl = slice(rank * T, (rank + 1) * T)
    d = build_dispatcher(
        c["kind"],
        num_experts=E,
        topk=k,
        ep_group=ps.groups.ep,
        etp_group=ps.groups.etp,
        capacity_factor=None if mode == "dropless" else c.get("cf", 1.0),
        pad_to_capacity=mode == "pad",
        **({"node_group": ps.groups.ep_node, "rail_group": ps.groups.ep_rail} if c["kind"] == "hierarchical" else {}),
    )
    if c.get("two_stage") is not None:  # the hierarchical dispatcher is two-stage exactly when EP spans nodes
        assert (type(d).__name__ == "HierarchicalDispatcher") == c["two_stage"], c
    L, Fs = E // c["ep"], FF // c["etp"]
    off, j = d.local_expert_offset, ps.coords.etp.rank
    A_l = A[off : off + L, :, j * Fs : (j + 1) * Fs].clone().requires_grad_(True)
    B_l = B[off : off + L, j * Fs : (j + 1) * Fs, :].clone().requires_grad_(True)
    xl = x[sl].clone().requires_grad_(True)
    pl = probs[sl].clone().requires_grad_(True)
    before = host_sync.count()
    shape = (T // 2, 2, H) if c.get("sbh") else (T, H)
    tokens, rec, pn = d.dispatch(xl.view(shape), rmap[sl], pl)
    tpe = rec.tokens_per_expert
    assert tpe.device.type == "cpu" and tpe.dtype == torch.long
    assert int(tpe.sum()) == tokens.shape[0] and list(rec.tokens_per_expert_host) == tpe.tolist()
    y = d.combine(_toy_experts(tokens, tpe, pn, A_l, B_l), rec)
    syncs = host_sync.count() - before
    assert y.shape == shape
    (y.reshape(T, H) * gy[sl]).sum().backward()
    return dict(
        y=y.detach().reshape(T, H), gx=xl.grad, gp=pl.grad, gA=A_l.grad, gB=B_l.grad, off=off, etp_rank=j, syncs=syncs
    )


def _run_cases(cases):
    """Every case on this rank; one ParallelState per (ep, etp) layout."""
    world, rank = dist.get_world_size(), dist.get_rank()
    states, results = {}, []
    try:
        for c in cases:
            key = (c["ep"], c["etp"], c.get("nvlink_domain"))
            if key not in states:
                states[key] = build_parallel_state(
                    ParallelLayout(world_size=world, ep=c["ep"], etp=c["etp"], nvlink_domain=key[2])
                )
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
        gp_d = torch.cat([r["gp"] for r in res])
        torch.testing.assert_close(gp_d, gp * rmap, msg=tag)
        # dropped pairs contribute nothing and get exactly zero gradient; a token that lost all its
        # experts gets a zero output and a zero input gradient
        assert (gp_d[(probs != 0) & ~rmap] == 0).all(), tag
        lost = ~rmap.any(1)
        assert (torch.cat([r["y"] for r in res])[lost] == 0).all(), tag
        assert (torch.cat([r["gx"] for r in res])[lost] == 0).all(), tag
        L, Fs = c["E"] // c["ep"], FF // c["etp"]
        sumA, sumB = torch.zeros_like(gA), torch.zeros_like(gB)
        for r in res:  # sum the EDP replicas' weight gradients into the full tensors
            j, off = r["etp_rank"], r["off"]
            sumA[off : off + L, :, j * Fs : (j + 1) * Fs] += r["gA"]
            sumB[off : off + L, j * Fs : (j + 1) * Fs, :] += r["gB"]
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
                out.append(
                    dict(
                        ep=ep,
                        etp=etp,
                        kind=kind,
                        mode=mode,
                        E=8,
                        topk=2,
                        seed=seed,
                        cf=1.0 if mode == "drop" else 1.5,
                        sbh=seed % 2 == 0,
                    )
                )
    return out


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_dispatchers_match_reference(ranks, world):
    cases = _cases(world)
    per_rank = ranks(world).run(_run_cases, cases)
    _check(world, cases, per_rank)


def _hier_cases(world):
    """Hierarchical dispatch with ``nvlink_domain`` making one machine several nodes: EP spanning
    nodes (two stages) and inside one (the all-to-all), dropless and dropping, with ETP2."""
    G = world // 2
    layouts = {4: [(4, 1, True), (2, 2, True)], 8: [(8, 1, True), (4, 2, True), (2, 2, False)]}[world]
    out, seed = [], 100
    for ep, etp, two in layouts:
        for mode in ("dropless", "drop"):
            for topk in (2, 5):
                seed += 1
                out.append(
                    dict(
                        ep=ep,
                        etp=etp,
                        kind="hierarchical",
                        mode=mode,
                        E=8,
                        topk=topk,
                        seed=seed,
                        cf=1.0,
                        sbh=seed % 2 == 0,
                        nvlink_domain=G,
                        two_stage=two,
                    )
                )
    return out


@pytest.mark.parametrize("world", [4, 8])
def test_hierarchical_matches_reference(ranks, world):
    """Outputs and gradients of tokens, probabilities and expert weights equal the single-process
    reference (and so the all-to-all's, tested against the same reference), one host read per layer."""
    cases = _hier_cases(world)
    per_rank = ranks(world).run(_run_cases, cases)
    _check(world, cases, per_rank)


# ------------------------------------------------------------------------------ quantized wires
HW, TW, EW, FW = 64, 6, 4, 8


class _WireSpy:
    """What crosses ``torch.distributed.all_to_all_single`` (the EP exchanges of every dispatcher), counted
    apart from the dispatchers' own byte statistics: per phase (``dispatch``, ``combine``, ``backward``),
    the row width in bytes and the rows of every ``uint8`` part (the encoded rows; the probabilities travel
    as float32) the rank sends."""

    def __init__(self):
        self.phase = None
        self.sent = {}  # phase -> {row width in bytes: rows sent}

    def __enter__(self):
        self._real = dist.all_to_all_single

        def spied(output, input, *args, **kwargs):
            if input.dtype == torch.uint8 and input.dim() == 2:
                widths = self.sent.setdefault(self.phase, {})
                widths[input.shape[1]] = widths.get(input.shape[1], 0) + input.shape[0]
            return self._real(output, input, *args, **kwargs)

        dist.all_to_all_single = spied
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._real


def wire_widths(fmt: str, h: int) -> set:
    """The byte widths of the parts of one encoded row of ``h`` fp32 values (``folding.moe.dispatch.wire``'s
    formats, written out: the rows themselves; e4m3 codes and one fp32 scale; e4m3 codes and one E8M0
    scale per 32 values)."""
    return {"none": {4 * h}, "fp8": {h, 4}, "mxfp8": {h, h // 32}}[fmt]


def _wire_run(ps, wires, world, rank, megatron_stages=False, per_expert_exchange=False, kind="alltoall", spy=None):
    spy = spy if spy is not None else _WireSpy()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(world * TW, HW, generator=g)
    scores = torch.rand(world * TW, EW, generator=g)
    rmap = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, scores.topk(2, dim=1).indices, True)
    probs = torch.where(rmap, scores, torch.zeros_like(scores))
    A = torch.randn(EW, HW, FW, generator=g) / 8
    Bw = torch.randn(EW, FW, HW, generator=g) / 3
    gy = torch.randn(world * TW, HW, generator=g)
    sl = slice(rank * TW, (rank + 1) * TW)
    extra = (
        dict(node_group=ps.groups.ep_node, rail_group=ps.groups.ep_rail)
        if kind == "hierarchical"
        else dict(megatron_stages=megatron_stages, per_expert_exchange=per_expert_exchange)
    )
    d = build_dispatcher(
        kind,
        num_experts=EW,
        topk=2,
        ep_group=ps.groups.ep,
        etp_group=ps.groups.etp,
        dispatch_wire=wires[0],
        combine_wire=wires[1],
        grad_wire=wires[2],
        **extra,
    )
    Fs, j, off = FW // ps.coords.etp.size, ps.coords.etp.rank, d.local_expert_offset
    xl, pl = x[sl].clone().requires_grad_(True), probs[sl].clone().requires_grad_(True)
    with spy:
        spy.phase = "dispatch"
        tok, rec, pn = d.dispatch(xl, rmap[sl], pl)
    outs, start = [], 0
    for l, n in enumerate(rec.tokens_per_expert_host):  # a linear expert: (x A_e p) B_e, F sharded over ETP
        e = off + l
        outs.append(
            (tok[start : start + n] @ A[e, :, j * Fs : (j + 1) * Fs] * pn[start : start + n, None])
            @ Bw[e, j * Fs : (j + 1) * Fs]
        )
        start += n
    with spy:
        spy.phase = "combine"
        y = d.combine(torch.cat(outs), rec)
        spy.phase = "backward"
        (y * gy[sl]).sum().backward()
    # elementwise bound (docs/dispatcher.md): with u = 2^-4 and sigma = 2^-9 amax/448 per row,
    # |y_q - y| <= sum_k p_k (u(2+u)|x| + (1+u) sigma_x) |A_e||B_e| + sigma_r(k)  (+ fp32 slack)
    u = 2.0**-4 if wires[0] != "none" else 0.0
    uc = 2.0**-4 if wires[1] != "none" else 0.0
    xs, ps_ = x[sl], probs[sl]
    sig_x = 2.0**-9 * xs.abs().amax(1, keepdim=True) / 448 * (u > 0)
    bound = torch.zeros_like(xs)
    for e in range(EW):
        M = A[e].abs() @ Bw[e].abs()
        r_abs = ((1 + u) * xs.abs() + sig_x) @ M * ps_[:, e : e + 1]
        term = ((u * (1 + uc) + uc) * xs.abs() + (1 + uc) * sig_x) @ M * ps_[:, e : e + 1]
        bound += term + 2.0**-9 * r_abs.amax(1, keepdim=True) / 448 * (uc > 0)
    return dict(y=y.detach(), gx=xl.grad, gp=pl.grad, bound=bound, bytes=dict(rec.stats), sent=spy.sent)


def _check_wire_directions(q, wires, ref, what):
    """Each direction's rows crossed EP in its own wire's format (counted by :class:`_WireSpy`), the
    dispatch's ``2·TW`` routed rows of this rank among them; the input gradient is exact on an exact
    gradient wire and off by a quantized one's error (non-zero, below 15%) otherwise."""
    fmt = dict(zip(("dispatch", "combine", "backward"), wires))
    for phase, wire in fmt.items():
        assert set(q["sent"].get(phase, {})) == wire_widths(wire, HW), (what, wires, phase, q["sent"])
    assert q["sent"]["dispatch"][min(wire_widths(fmt["dispatch"], HW), key=lambda w: -w)] == 2 * TW, (what, wires)
    rel = ((q["gx"] - ref["gx"]).norm() / ref["gx"].norm()).item()
    if wires[2] == "none":
        assert rel == 0.0, (what, wires, rel)
    else:
        assert 1e-4 < rel < 0.15, (what, wires, rel)


def _wire_cases(wire_sets):
    world, rank = dist.get_world_size(), dist.get_rank()
    out = []
    for ep, etp in ((2, 2), (4, 1)):
        ps = build_parallel_state(ParallelLayout(world_size=world, ep=ep, etp=etp))
        try:
            ref = _wire_run(ps, ("none", "none", "none"), world, rank)
            for wires in wire_sets:
                q = _wire_run(ps, wires, world, rank)
                err = (q["y"] - ref["y"]).abs()
                assert (err <= q["bound"] + 1e-5 * ref["y"].abs() + 1e-7).all(), (
                    wires,
                    ep,
                    etp,
                    (err - q["bound"]).max(),
                )
                if wires[0] != "none" or wires[1] != "none":
                    assert err.max() > 0, "the wire should have quantized something"
                _check_wire_directions(q, wires, ref, (ep, etp))
                # gradients flow through the quantized exchanges and stay close to the exact ones
                for k in ("gx", "gp"):
                    rel = (q[k] - ref[k]).norm() / ref[k].norm()
                    assert q[k].abs().sum() > 0 and rel < 0.15, (wires, k, float(rel))
                # the ETP exchange at Megatron-Core's stage boundaries: the same bits (the decoded rows
                # cross ETP instead of the encoded ones)
                m = _wire_run(ps, wires, world, rank, megatron_stages=True)
                for k in ("y", "gx", "gp"):
                    assert torch.equal(m[k], q[k]), (wires, ep, etp, k)
                out.append((ep, etp, wires, q["bytes"]["ep_dispatch_bytes"], ref["bytes"]["ep_dispatch_bytes"]))
        finally:
            ps.destroy()
    # one all-to-all per local expert (EP2, two local experts), the probabilities in one call: the
    # same bits as the single all-to-all under every wire (each row is encoded alone; top-2)
    ps = build_parallel_state(ParallelLayout(world_size=world, ep=2, etp=1))
    try:
        for wires in [("none", "none", "none")] + list(wire_sets):
            one = _wire_run(ps, wires, world, rank)
            sliced = _wire_run(ps, wires, world, rank, per_expert_exchange=True)
            for k in ("y", "gx", "gp"):
                assert torch.equal(one[k], sliced[k]), (wires, "per_expert_exchange", k)
            out.append((2, 1, ("per_expert",) + tuple(wires), 0, 0))
    finally:
        ps.destroy()
    return out


def _hier_wire_cases(wire_sets):
    """The hierarchical dispatcher (4 ranks as 2 nodes of 2) under each wire set, against the
    all-to-all dispatcher under the same wires and against the exact (unquantized) run."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out = []
    for ep, etp in ((4, 1), (2, 2)):
        ps = build_parallel_state(ParallelLayout(world_size=world, ep=ep, etp=etp, nvlink_domain=2))
        try:
            ref = _wire_run(ps, ("none", "none", "none"), world, rank)
            for wires in wire_sets:
                h = _wire_run(ps, wires, world, rank, kind="hierarchical")
                a = _wire_run(ps, wires, world, rank)
                _check_wire_directions(a, wires, ref, ("alltoall", ep, etp))
                # both stages, each direction in its wire; the first pass also sends each row's routing map
                # (bool as uint8: the node's ranks × local experts at the rail stage, local experts at the node's)
                L, g = EW // ep, dist.get_world_size(ps.groups.ep_node)  # EP ranks per node
                meta = {g * L} | ({L} if g > 1 else set())  # a node of one EP rank has no node stage
                for phase, wire in zip(("dispatch", "combine", "backward"), wires):
                    expect = wire_widths(wire, HW) | (meta if phase == "dispatch" else set())
                    assert set(h["sent"].get(phase, {})) == expect, (ep, etp, wires, phase, h["sent"])
                if wires[1] == "none":  # the dispatch wire rounds once (stage B forwards the encoded bytes)
                    torch.testing.assert_close(h["y"], a["y"], rtol=1e-5, atol=1e-6, msg=str(wires))
                else:  # the combine rounds at both hops: within twice the all-to-all's bound
                    err = (h["y"] - ref["y"]).abs()
                    assert (err <= 2 * a["bound"] + 1e-5 * ref["y"].abs() + 1e-7).all(), (wires, ep, etp)
                    assert err.max() > 0
                for k in ("gx", "gp"):
                    rel = (h[k] - ref[k]).norm() / ref[k].norm()
                    assert h[k].abs().sum() > 0 and rel < 0.15, (wires, k, float(rel))
                out.append((ep, etp, wires, h["bytes"]["inter_node_dispatch_bytes"], h["bytes"]["remote_rows_sent"]))
        finally:
            ps.destroy()
    return out


def test_hierarchical_quantized_wires(ranks):
    wire_sets = [("mxfp8", "none", "none"), ("fp8", "fp8", "fp8"), ("none", "mxfp8", "mxfp8"), ("fp8", "none", "mxfp8")]
    for ep, etp, wires, sent, rows in ranks(4).run(_hier_wire_cases, wire_sets)[0]:
        per_row = {"mxfp8": HW + HW // 32, "fp8": HW + 4, "none": HW * 4}[wires[0]]
        assert sent == rows * per_row, (ep, etp, wires)


def test_quantized_wires_bounded_error_and_bytes(ranks):
    wire_sets = [
        ("mxfp8", "none", "none"),
        ("none", "mxfp8", "mxfp8"),
        ("fp8", "fp8", "fp8"),
        ("mxfp8", "mxfp8", "none"),
        ("fp8", "none", "mxfp8"),  # three directions, three formats
    ]
    res = ranks(4).run(_wire_cases, wire_sets)
    assert sum(w[0] == "per_expert" for _, _, w, _, _ in res[0]) == len(wire_sets) + 1
    for ep, etp, wires, q_bytes, ref_bytes in res[0]:
        if wires[0] == "mxfp8":  # fp32 rows: (H + H/32) / 4H of the unquantized bytes
            assert q_bytes == pytest.approx(ref_bytes * (HW + HW // 32) / (4 * HW))


# ------------------------------------------------------------------------------------ bad input
def _bad_inputs():
    ps = build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), ep=2, etp=1))
    errors = []
    try:

        def expect(match, fn):
            with pytest.raises(ValueError, match=match):
                fn()
            errors.append(match)

        kw = dict(topk=2, ep_group=ps.groups.ep, etp_group=ps.groups.etp)
        expect(
            r"num_experts=3 is not divisible by the EP group size 2",
            lambda: build_dispatcher("alltoall", num_experts=3, **kw),
        )
        expect(
            r"must meet only at this rank",
            lambda: build_dispatcher("alltoall", num_experts=4, topk=2, ep_group=ps.groups.ep, etp_group=ps.groups.ep),
        )
        expect(
            r"num_local_experts=4 but num_experts/EP",
            lambda: build_dispatcher("alltoall", num_experts=4, num_local_experts=4, **kw),
        )
        expect(r"moe.dispatcher='ring'", lambda: build_dispatcher("ring", num_experts=4, **kw))
        expect(
            r"allgather dispatcher sends the activation dtype only",
            lambda: build_dispatcher("allgather", num_experts=4, dispatch_wire="mxfp8", **kw),
        )
        expect(
            r"pad_to_capacity=True needs a capacity_factor",
            lambda: build_dispatcher("alltoall", num_experts=4, pad_to_capacity=True, **kw),
        )
        d = build_dispatcher("alltoall", num_experts=4, dispatch_wire="fp8", **kw)
        rmap = torch.zeros(3, 4, dtype=torch.bool)
        rmap[:, :2] = True
        expect(
            r"moe.dispatch_wire='fp8' quantizes from fp32/bf16/fp16",
            lambda: d.dispatch(torch.zeros(3, 64, dtype=torch.float64), rmap, rmap.double()),
        )
        expect(
            r"routing_map must be bool \[T=3, E=4\]", lambda: d.dispatch(torch.zeros(3, 64), rmap[:, :3], rmap.float())
        )
        # every error came before any collective: the ranks are still in step
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == dist.get_world_size()
    finally:
        ps.destroy()
    return errors


def test_bad_inputs_fail_before_any_collective(ranks):
    assert all(len(e) == 8 for e in ranks(2).run(_bad_inputs))
