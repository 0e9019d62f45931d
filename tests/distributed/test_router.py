"""Router on 1, 2 and 4 gloo ranks with TP×CP-split tokens against the 1-rank router on the whole
micro-batch: aux / seq-aux / global-aux / z-loss values (shares summed over their group), routing
outputs, and gate-weight gradients (sequence-parallel partial grads summed over TP×CP, plus DP for
global_aux_loss). Expert bias: one update per global batch moves every rank's bias identically."""

import pytest
import torch
import torch.distributed as dist

from folding.moe.config import MoEConfig
from folding.moe.routing.router import Router
from folding.optim.expert_bias import update_expert_biases
from folding.parallel import ParallelLayout, ProcessGroups, build_parallel_state

S, B, H, E = 8, 2, 6, 4
SCALE = 0.7
CONFIGS = [
    dict(aux_loss_type="aux_loss", router_dtype="fp64"),
    dict(aux_loss_type="seq_aux_loss", router_dtype="fp64", score_function="sigmoid"),
    # z-loss off: it is a per-micro-batch mean, so the reference seeing every DP replica's tokens
    # at once would average it over DP (z-loss under DP is covered by the other configs)
    dict(aux_loss_type="global_aux_loss", router_dtype="fp64", pre_softmax=True, topk=1, z_loss_coeff=0.0),
    dict(aux_loss_type="aux_loss", router_dtype="fp32", num_groups=2, group_topk=1),
    # padded sequences: ranks hold different numbers of valid tokens
    dict(aux_loss_type="aux_loss", router_dtype="fp64", padding=True),
    dict(aux_loss_type="seq_aux_loss", router_dtype="fp64", padding=True),
    dict(aux_loss_type="global_aux_loss", router_dtype="fp64", z_loss_coeff=0.0, padding=True),
]
LAYOUTS = {
    1: [dict()],
    2: [dict(tp=2), dict(cp=2)],
    4: [dict(tp=2, cp=2), dict(tp=4), dict(cp=4), dict(tp=2, dp=2), dict(cp=2, dp=2), dict(dp=4)],
}
MICRO_BATCHES = 2


def _cfg(kw):
    base = dict(num_experts=E, topk=2, ffn_hidden_size=8, aux_loss_coeff=0.3, z_loss_coeff=0.05)
    base.update({k: v for k, v in kw.items() if k != "padding"})
    return MoEConfig(**base)


def _inputs(dp_rank, mb):
    """The global micro-batch ``mb`` of DP replica ``dp_rank``: hidden [S, B, H], upstream grad of
    the probs [S, B, E] (stands in for the rest of the model)."""
    g = torch.Generator().manual_seed(1000 * dp_rank + mb)
    x = torch.randn(S, B, H, generator=g, dtype=torch.float64)
    grad = torch.randn(S, B, E, generator=g, dtype=torch.float64)
    # padding (used by the padded configs): sequence b ends with 1 + b + dp_rank + mb padding tokens
    pad = torch.arange(S).unsqueeze(1) >= S - 1 - torch.arange(B) - dp_rank - mb
    return x, grad.masked_fill(pad.unsqueeze(-1), 0.0), pad


def _positions(tp, cp, tp_rank, cp_rank):
    """Sequence positions of this rank: CP takes load-balanced chunks c and 2·CP−1−c, then sequence
    parallelism splits them contiguously over TP."""
    chunks = torch.arange(S).chunk(2 * cp)
    mine = torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]])
    return mine.chunk(tp)[tp_rank]


def _run(router, batches, rows, padding):
    """Forward+backward over micro-batches; per micro-batch: losses (shares), probs, map."""
    out = []
    for x, g, pad in batches:
        routed = router(x[rows], aux_loss_scale=SCALE, padding_mask=pad[rows] if padding else None)
        probs, rmap = routed.probs_TE, routed.routing_map_TE
        (probs * g[rows].reshape(-1, E).to(probs.dtype)).sum().backward()
        out.append(({k: float(v) for k, v in routed.stats.losses.items()}, probs.detach(), rmap))
    return out


def _rank_fn(layout_kws, cfg_kws):
    results = []
    for lkw in layout_kws:
        ps = build_parallel_state(
            ParallelLayout(world_size=dist.get_world_size(), **{k: v for k, v in lkw.items() if k != "dp"})
        )
        try:
            assert ps.coords.dp.size == lkw.get("dp", 1)
            rows = _positions(ps.coords.tp.size, ps.coords.cp.size, ps.coords.tp.rank, ps.coords.cp.rank)
            for ckw in cfg_kws:
                r = Router(
                    hidden_size=H,
                    config=_cfg(ckw),
                    groups=ps.groups,
                    init_seed=5,
                    layer_number=2,
                )
                batches = [_inputs(ps.coords.dp.rank, mb) for mb in range(MICRO_BATCHES)]
                runs = _run(r, batches, rows, ckw.get("padding", False))
                grad = r.weight.grad.clone()
                group = ps.groups.tp_dp_cp if ckw["aux_loss_type"] == "global_aux_loss" else ps.groups.tp_cp
                dist.all_reduce(grad, group=group)  # sum the sequence-parallel partial gradients
                shares = [run[0] for run in runs]
                totals = []
                for mb_losses in shares:
                    t = {}
                    for name, v in mb_losses.items():
                        grp = ps.groups.tp_dp_cp if name == "global_aux_loss" else ps.groups.tp_cp
                        s = torch.tensor(v, dtype=torch.float64)
                        dist.all_reduce(s, group=grp)
                        t[name] = s.item()
                    totals.append(t)
                results.append(
                    dict(
                        layout=lkw,
                        cfg=ckw,
                        dp_rank=ps.coords.dp.rank,
                        rows=rows.tolist(),
                        totals=totals,
                        grad=grad,
                        probs=[run[1] for run in runs],
                        maps=[run[2] for run in runs],
                    )
                )
        finally:
            ps.destroy()
    return results


_REF_CACHE = {}


def _reference(ckw, dp, dp_ranks):
    """1-rank router on the whole micro-batch(es): for global_aux_loss, one rank sees the micro-batch
    of every DP replica at once (its counts span TP×DP×CP)."""
    key = (repr(ckw), tuple(dp_ranks))
    if key in _REF_CACHE:
        return _REF_CACHE[key]
    r = Router(hidden_size=H, config=_cfg(ckw), groups=ProcessGroups(), init_seed=5, layer_number=2)
    batches = []
    for mb in range(MICRO_BATCHES):
        xs, gs, pads = zip(*[_inputs(d, mb) for d in dp_ranks])
        batches.append((torch.cat(xs, 1), torch.cat(gs, 1), torch.cat(pads, 1)))
    runs = _run(r, batches, slice(None), ckw.get("padding", False))
    out = [run[0] for run in runs], r.weight.grad, [run[1] for run in runs], [run[2] for run in runs]
    _REF_CACHE[key] = out
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_router_losses_and_grads_match_one_rank(ranks, world):
    layouts = LAYOUTS[world]
    per_rank = ranks(world).run(_rank_fn, layouts, CONFIGS)
    checked = 0
    for rank, res in enumerate(per_rank):
        for item in res:
            ckw, dp = item["cfg"], item["layout"].get("dp", 1)
            tol = dict(rtol=1e-11, atol=1e-13) if ckw["router_dtype"] == "fp64" else dict(rtol=1e-5, atol=1e-6)
            glob = ckw["aux_loss_type"] == "global_aux_loss"
            ref_losses, ref_grad, ref_probs, ref_maps = _reference(ckw, dp, range(dp) if glob else [item["dp_rank"]])
            for mb in range(MICRO_BATCHES):
                expected = {ckw["aux_loss_type"]} | ({"z_loss"} if ckw.get("z_loss_coeff", 1) else set())
                assert set(item["totals"][mb]) == expected
                for name, v in item["totals"][mb].items():
                    torch.testing.assert_close(v, ref_losses[mb][name], **tol, msg=f"{item['layout']} {ckw} {name}")
                # this rank's rows of the reference routing (token t = s·B' + b over the reference batch)
                bsel = torch.arange(B) + (item["dp_rank"] * B if glob else 0)
                ref_p = ref_probs[mb].view(S, -1, E)[item["rows"]][:, bsel].reshape(-1, E)
                ref_m = ref_maps[mb].view(S, -1, E)[item["rows"]][:, bsel].reshape(-1, E)
                torch.testing.assert_close(item["probs"][mb], ref_p, **tol)
                assert torch.equal(item["maps"][mb], ref_m)
            # the gate weight (and so its gradient) is fp32 whatever the router dtype
            torch.testing.assert_close(item["grad"], ref_grad, rtol=1e-5, atol=1e-7, msg=f"{item['layout']} {ckw} grad")
            checked += 1
    assert checked == world * len(layouts) * len(CONFIGS)


def _bias_fn(rate):
    ps = build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), tp=2))
    try:
        cfg = MoEConfig(
            num_experts=E,
            topk=2,
            ffn_hidden_size=8,
            expert_bias=True,
            expert_bias_update_rate=rate,
            aux_loss_type="none",
        )
        r = Router(hidden_size=H, config=cfg, groups=ps.groups)
        with torch.no_grad():
            r.expert_bias.copy_(torch.tensor([0.3, 0.0, -0.2, 0.1]))  # a bias from earlier steps
        start = r.expert_bias.clone()
        counts = torch.zeros(E)
        probs_ok = True
        for mb in range(3):  # one global batch
            x = torch.randn(5, H, generator=torch.Generator().manual_seed(10 * dist.get_rank() + mb))
            x[:, 0] += 2.0  # skew the load
            routed = r(x)
            probs, rmap = routed.probs_TE, routed.routing_map_TE
            counts += rmap.sum(0)
            raw = torch.softmax(torch.where(rmap, x @ r.weight.detach().T, float("-inf")), -1)
            probs_ok &= torch.allclose(probs, raw, atol=1e-6)  # selection only: probs unbiased
        update_expert_biases([r], group=ps.groups.tp_dp_cp)
        return dict(
            start=start,
            bias=r.expert_bias.clone(),
            counts=counts,
            probs_ok=probs_ok,
            left=r.local_tokens_per_expert.clone(),
        )
    finally:
        ps.destroy()


def test_expert_bias_update_is_global_and_balancing(ranks):
    rate = 0.01
    res = ranks(4).run(_bias_fn, rate)
    total = sum(r["counts"] for r in res)  # counts over TP×DP×CP
    step = torch.sign(total.mean() - total) * rate
    assert (step > 0).any() and (step < 0).any()  # the case is unbalanced
    for r in res:
        assert r["probs_ok"]
        assert not r["left"].any()
        torch.testing.assert_close(r["bias"], r["start"] + step)  # ±rate towards balance
        assert torch.equal(r["bias"], res[0]["bias"])  # identical on every rank
