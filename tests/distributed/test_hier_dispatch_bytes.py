"""What the hierarchical dispatcher hands to ``torch.distributed``, counted per destination node.

Every ``all_to_all_single`` call is wrapped on each rank to record the bytes it sends to each
destination rank (input split sizes × row bytes of every part), mapped to the destination's node
(``parallel.nvlink_domain`` ranks per node). The inter-node payload must equal the de-duplicated
minimum: for every token, the distinct remote nodes it is routed to × the bytes of one row, in
forward (dispatch rows carry the hidden state plus the node's ``g·L`` probabilities and map bytes,
combine rows the hidden state) and backward (the same rows the other way, the dispatch's backward
also carrying the probabilities' gradients). The all-to-all dispatcher's inter-node bytes, counted
the same way on the same routing, are one row per remote (token, expert) pair: more whenever a token
has two experts on one remote node. Also here: node-limited routing (``moe.num_groups`` = nodes,
``moe.group_topk`` = M) sends at most M rail rows per token, the six-stage interface gives what
``dispatch`` / ``combine`` give, and ``build_dispatcher`` given only ``nvlink_domain`` builds the same
node and rail groups as the layout.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

from folding.interop.megatron.stages import MegatronDispatcher
from folding.moe.config import MoEConfig
from folding.moe.dispatch.build import build_dispatcher
from folding.moe.routing.functions import topk_routing
from folding.parallel import ParallelLayout, build_parallel_state

H, T = 16, 12


@contextlib.contextmanager
def _count_bytes(G):
    """Record ``{dest node: bytes}`` of every all_to_all_single of token rows this rank issues (self
    excluded; the token exchanges always give their split sizes, the count gather none)."""
    sent = {}
    real = dist.all_to_all_single

    def wrapped(out, x, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if input_split_sizes is None:  # equal splits: the token counts (on gloo an all-to-all), not rows
            return real(out, x, group=group, async_op=async_op)
        ranks = dist.get_process_group_ranks(group)
        row = (x.numel() // x.shape[0]) * x.element_size() if x.shape[0] else 0
        for peer, n in zip(ranks, input_split_sizes):
            if peer != dist.get_rank():
                sent[peer // G] = sent.get(peer // G, 0) + n * row
        return real(out, x, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = wrapped
    try:
        yield sent
    finally:
        dist.all_to_all_single = real


def _routing(E, k, seed, groups=None, group_topk=None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(dist.get_world_size() * T, E, generator=g)
    probs, rmap = topk_routing(logits, topk=k, num_groups=groups, group_topk=group_topk)
    x = torch.randn(dist.get_world_size() * T, H, generator=g)
    return x, probs, rmap


def _bytes_run(case):
    world, rank = dist.get_world_size(), dist.get_rank()
    G, ep, etp, E, k = case["G"], case["ep"], case["etp"], case["E"], case["topk"]
    ps = build_parallel_state(ParallelLayout(world_size=world, ep=ep, etp=etp, nvlink_domain=G))
    out = {}
    try:
        x, probs, rmap = _routing(E, k, case["seed"])
        sl = slice(rank * T, (rank + 1) * T)
        for kind in ("hierarchical", "alltoall"):
            d = build_dispatcher(
                kind,
                num_experts=E,
                topk=k,
                ep_group=ps.groups.ep,
                etp_group=ps.groups.etp,
                **(
                    {"node_group": ps.groups.ep_node, "rail_group": ps.groups.ep_rail} if kind == "hierarchical" else {}
                ),
            )
            xl = x[sl].clone().requires_grad_(True)
            pl = probs[sl].clone().requires_grad_(True)
            with _count_bytes(G) as fwd_d:
                rows, rec, pn = d.dispatch(xl, rmap[sl], pl)
            y_rows = rows * pn.unsqueeze(1)
            with _count_bytes(G) as fwd_c:
                y = d.combine(y_rows, rec)
            with _count_bytes(G) as bwd:
                y.sum().backward()
            me = rank // G
            out[kind] = {
                "fwd_dispatch": sum(v for n, v in fwd_d.items() if n != me),
                "fwd_combine": sum(v for n, v in fwd_c.items() if n != me),
                "bwd": sum(v for n, v in bwd.items() if n != me),
                "y": y.detach(),
                "gx": xl.grad,
                "gp": pl.grad,
            }
    finally:
        ps.destroy()
    return out


def _expected(case, world):
    """Distinct remote nodes per token, summed over every rank's tokens (this rank's node is the
    source's: rank r's tokens are rows r*T ... of the global map), and remote (token, expert) pairs."""
    G, E, ep = case["G"], case["E"], case["ep"]
    g = torch.Generator().manual_seed(case["seed"])
    logits = torch.randn(world * T, E, generator=g)
    _, rmap = topk_routing(logits, topk=case["topk"])
    lay = ParallelLayout(world_size=world, ep=ep, etp=case["etp"])
    ep_of = {r: grp for grp in lay.groups()["expert"]["ep"] for r in grp}
    L = E // ep
    nodes = pairs = 0
    for t in range(world * T):
        src = t // T
        dest_ranks = [ep_of[src][e // L] for e in rmap[t].nonzero().flatten().tolist()]
        remote = [r // G for r in dest_ranks if r // G != src // G]
        nodes += len(set(remote))
        pairs += len(remote)
    return nodes, pairs


CASES = {
    4: [dict(G=2, ep=4, etp=1, E=8, topk=4, seed=1), dict(G=2, ep=2, etp=2, E=8, topk=3, seed=2)],
    8: [dict(G=4, ep=8, etp=1, E=16, topk=6, seed=3), dict(G=4, ep=4, etp=2, E=16, topk=4, seed=4)],
}


@pytest.mark.parametrize("world", [4, 8])
def test_inter_node_bytes_are_the_deduplicated_minimum(ranks, world):
    for case in CASES[world]:
        res = ranks(world).run(_bytes_run, case)
        nodes, pairs = _expected(case, world)
        lay = ParallelLayout(world_size=world, ep=case["ep"], etp=case["etp"], nvlink_domain=case["G"])
        g = len(lay.groups()["expert"]["ep-node"][0])  # EP ranks per node
        ln = g * case["E"] // case["ep"]  # the node's experts: probabilities (fp32) and map (1 byte) per row
        hid = H * 4
        tot = {
            kind: {p: sum(r[kind][p] for r in res) for p in ("fwd_dispatch", "fwd_combine", "bwd")} for kind in res[0]
        }
        hier, a2a = tot["hierarchical"], tot["alltoall"]
        print(case, "remote nodes", nodes, "remote pairs", pairs, "hier", hier, "alltoall", a2a)
        assert nodes < pairs, "the case should route some token to two experts of one remote node"
        assert hier["fwd_dispatch"] == nodes * (hid + ln * 4 + ln), case
        assert hier["fwd_combine"] == nodes * hid, case
        # backward: the combine's backward sends hidden gradients the dispatch way, the dispatch's
        # backward sends the partial gradients back with the probabilities' gradients (fp32)
        assert hier["bwd"] == nodes * (hid + hid + ln * 4), case
        # the all-to-all dispatcher: one row per remote (token, expert) pair, plus one probability each
        assert a2a["fwd_dispatch"] == pairs * (hid + 4) and a2a["fwd_combine"] == pairs * hid, case
        # the same numbers either way
        for r in res:
            torch.testing.assert_close(r["hierarchical"]["y"], r["alltoall"]["y"])
            torch.testing.assert_close(r["hierarchical"]["gx"], r["alltoall"]["gx"])
            torch.testing.assert_close(r["hierarchical"]["gp"], r["alltoall"]["gp"])


def _node_limited_run(M):
    """EP8 over 2 nodes of 4 with 4 nodes' worth of groups: route with num_groups = nodes (2) and
    group_topk = M; count the rail rows per token, and run the six stages against dispatch/combine."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ps = build_parallel_state(ParallelLayout(world_size=world, ep=world, nvlink_domain=world // 2))
    try:
        E, k = 16, 4
        MoEConfig(num_experts=E, topk=k, ffn_hidden_size=8, num_groups=2, group_topk=M, dispatcher="hierarchical")
        g = torch.Generator().manual_seed(7)
        logits = torch.randn(world * T, E, generator=g)[rank * T : (rank + 1) * T]
        probs, rmap = topk_routing(logits, topk=k, num_groups=2, group_topk=M)
        x = torch.randn(world * T, H, generator=g)[rank * T : (rank + 1) * T]
        d = build_dispatcher(
            "hierarchical",
            num_experts=E,
            topk=k,
            ep_group=ps.groups.ep,
            etp_group=ps.groups.etp,
            node_group=ps.groups.ep_node,
            rail_group=ps.groups.ep_rail,
            nvlink_domain=world // 2,
        )
        rows, rec, pn = d.dispatch(x, rmap, probs)
        per_token = torch.bincount(rec.plan.token_Ra, minlength=T)
        y = d.combine(rows * pn.unsqueeze(1), rec)
        # the six stages, one call at a time, give the same rows and output
        s6 = MegatronDispatcher(d)
        h, p = s6.dispatch_preprocess(x, rmap, probs)
        h, p = s6.token_dispatch(h, p)
        rows6, tpe6, pn6 = s6.dispatch_postprocess(h, p)
        out6 = s6.combine_postprocess(s6.token_combine(s6.combine_preprocess(rows6 * pn6.unsqueeze(1))))
        same = torch.equal(rows6, rows) and torch.equal(pn6, pn) and torch.equal(out6, y)
        # given nvlink_domain alone, build_dispatcher creates the same two groups (collectively)
        d2 = build_dispatcher(
            "hierarchical",
            num_experts=E,
            topk=k,
            ep_group=ps.groups.ep,
            etp_group=ps.groups.etp,
            nvlink_domain=world // 2,
        )
        try:
            rows2, rec2, pn2 = d2.dispatch(x, rmap, probs)
            same = same and torch.equal(d2.combine(rows2 * pn2.unsqueeze(1), rec2), y)
            same = same and [dist.get_process_group_ranks(g) for g in (d2.node_group, d2.rail_group)] == [
                list(ps.coords.ep_node.ranks),
                list(ps.coords.ep_rail.ranks),
            ]
        finally:
            dist.barrier()
            for grp in (d2.node_group, d2.rail_group):
                dist.destroy_process_group(grp)
        return int(per_token.max()), same, torch.equal(tpe6, rec.tokens_per_expert)
    finally:
        ps.destroy()


def test_node_limited_routing_sends_at_most_m_rail_rows_per_token(ranks):
    res1 = ranks(8).run(_node_limited_run, 1)
    assert all(r[0] == 1 for r in res1), res1  # top-4 of 16 inside one node: one rail row per token
    assert all(r[1] and r[2] for r in res1), res1
    res2 = ranks(8).run(_node_limited_run, 2)
    assert max(r[0] for r in res2) == 2, res2  # two nodes allowed, and some token uses both
