"""The dispatchers' token counts travel on the EP ranks' metadata communicator (``ProcessGroups.ep_meta``),
not on the EP communicator that carries the token payloads, for both dispatchers that gather counts
(``alltoall`` and ``hierarchical``, the latter with the 4 ranks as 2 nodes of 2). Under the link model
with NCCL's order, a count read behind a token exchange still in flight on EP therefore does not wait
for it; with the counts on EP (``counts_group=None``) it does: the cost ``ep_meta`` removes.

The count gather over ETP likewise runs on the ETP ranks' metadata communicator
(``ProcessGroups.etp_meta``), not behind the ETP payloads on ``etp`` (EP2 x ETP2).

The count all-gather is recognised by its group: every count gather a layer forward starts
(``gather_counts_start``) is recorded with the group it ran on. On gloo that gather travels as one
all-to-all (one round of direct messages, not gloo's ring): the last test checks it gives the
all-gather's result, on the world and on subgroups."""

import pytest
import torch
import torch.distributed as dist

import folding.moe.dispatch.alltoall as a2a_mod
import folding.moe.dispatch.hierarchical as hier_mod
from folding.moe.config import MoEConfig
from folding.moe.dispatch.build import build_dispatcher
from folding.moe.layer import build_moe_layer
from folding.moe.settings import LayerSettings
from folding.overlap.exchange import Exchange
from folding.overlap.runtime import OverlapRuntime
from folding.parallel import ParallelLayout, build_parallel_state
from folding.parallel.collectives import all_gather_start, gather_counts_start
from folding.testing.link_model_v1 import link_latency
from folding.testing.overlap_audit import wait_stats

H, S, B, E = 16, 8, 2, 8
LATENCY_S = 0.3


def _cfg(dispatcher):
    return MoEConfig(num_experts=E, topk=2, ffn_hidden_size=8, dispatcher=dispatcher, aux_loss_coeff=0.0)


def _recording(mod, seen):
    real = mod.gather_counts_start

    def start(t, group):
        seen.append(group)
        return real(t, group)

    return real, start


def _counts_groups():
    """Per dispatcher: whether every count all-gather of a forward ran on ep_meta (and none on ep),
    and the seconds a count read waited behind a token exchange in flight on EP, with the counts on
    ep_meta and on EP."""
    out = {}
    lay = ParallelLayout(world_size=dist.get_world_size(), ep=4, etp=1, nvlink_domain=2)
    with build_parallel_state(lay) as ps:
        assert ps.groups.ep_meta is not None and ps.groups.ep_meta is not ps.groups.ep
        for kind, mod in (("alltoall", a2a_mod), ("hierarchical", hier_mod)):
            layer = build_moe_layer(
                _cfg(kind), hidden_size=H, groups=ps.groups, layer_number=1, settings=LayerSettings(init_seed=5)
            )
            seen = []
            real, spy = _recording(mod, seen)
            mod.gather_counts_start = spy
            try:
                x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(ps.rank))
                layer(x)
            finally:
                mod.gather_counts_start = real
            waited = {}
            for name, counts_group in (("ep_meta", ps.groups.ep_meta), ("ep", None)):
                kw = dict(num_experts=E, topk=2, ep_group=ps.groups.ep, etp_group=ps.groups.etp)
                if kind == "hierarchical":
                    kw.update(node_group=ps.groups.ep_node, rail_group=ps.groups.ep_rail)
                d = build_dispatcher(kind, counts_group=counts_group, **kw)
                hidden = torch.randn(S * B, H, generator=torch.Generator().manual_seed(ps.rank))
                logits = torch.randn(S * B, E, generator=torch.Generator().manual_seed(ps.rank + 9))
                top = logits.topk(2, dim=-1).indices
                routing = torch.zeros(S * B, E, dtype=torch.bool).scatter_(1, top, True)
                probs = torch.where(routing, logits.softmax(-1), 0.0)
                dist.barrier()
                runtime = OverlapRuntime()
                with runtime.active(), link_latency(runtime, LATENCY_S), wait_stats(runtime) as waits:
                    tokens = Exchange([], what="ep dispatch", group=ps.groups.ep)  # in flight on EP
                    waits.reset()
                    d.dispatch(hidden, routing, probs)  # its count read comes first, then its own exchanges
                    waited[name] = waits.blocked_s
                    tokens.wait()
            out[kind] = dict(
                on_meta=sum(g is ps.groups.ep_meta for g in seen),
                on_ep=sum(g is ps.groups.ep for g in seen),
                waited=waited,
            )
    return out


@pytest.mark.usefixtures("one_thread")
def test_counts_on_their_own_communicator(ranks):
    for per_rank in ranks(4).run(_counts_groups):
        for kind, r in per_rank.items():
            assert r["on_meta"] == 1 and r["on_ep"] == 0, (kind, r)  # one count gather per forward, on ep_meta
            # on EP the count read waits behind the token exchange issued before it (one latency more in
            # all); on ep_meta it does not, and the dispatch's own exchanges take the same time in both
            extra = r["waited"]["ep"] - r["waited"]["ep_meta"]
            assert extra > 0.7 * LATENCY_S, (kind, r)


def _gathers():
    """Per shape and group: the count gather's output, the all-gather's, and which collectives the count
    gather called (it is an all-to-all on gloo)."""
    world = dist.get_world_size()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[dist.get_rank() // 2]
    calls, real_a2a = [], dist.all_to_all_single
    out = []
    try:
        dist.all_to_all_single = lambda *a, **k: calls.append("all_to_all") or real_a2a(*a, **k)
        for group, n in ((None, world), (pair, 2)):
            for shape in ((1, 8), (1, 2, 8), (3, 5)):
                g = torch.Generator().manual_seed(10 * dist.get_rank() + len(shape))
                x = torch.randint(0, 1000, shape, generator=g)
                mine, work = gather_counts_start(x, group)
                work.wait()
                ref, work = all_gather_start(x, group)
                work.wait()
                out.append((n, x.shape[0], mine.shape[0], torch.equal(mine, ref)))
    finally:
        dist.all_to_all_single = real_a2a
        for p in pairs:
            dist.destroy_process_group(p)
    return out, calls


@pytest.mark.usefixtures("one_thread")
def test_the_count_gather_equals_the_all_gather_in_one_round_on_gloo(ranks):
    for out, calls in ranks(4).run(_gathers):
        assert calls == ["all_to_all"] * 6  # every count gather one all-to-all (gloo's all-gather is a ring)
        for n, rows, gathered, equal in out:
            assert equal and gathered == n * rows, (n, rows, gathered)


def _etp_counts_groups():
    """Per dispatcher, on EP2 x ETP2 (the hierarchical one with its EP groups across 2 nodes of 2): the
    groups the count all-gathers over ETP ran on during one layer forward."""
    out = {}
    lay = ParallelLayout(world_size=dist.get_world_size(), tp=2, ep=2, etp=2, nvlink_domain=2)
    with build_parallel_state(lay) as ps:
        assert ps.groups.etp_meta is not None and ps.groups.etp_meta is not ps.groups.etp
        for kind, mod in (("alltoall", a2a_mod), ("hierarchical", hier_mod)):
            layer = build_moe_layer(
                _cfg(kind), hidden_size=H, groups=ps.groups, layer_number=1, settings=LayerSettings(init_seed=5)
            )
            seen, real = [], mod.all_gather_nograd
            mod.all_gather_nograd = lambda t, group, **kw: seen.append(group) or real(t, group, **kw)
            try:
                layer(torch.randn(S, B, H, generator=torch.Generator().manual_seed(ps.rank // 2)))
            finally:
                mod.all_gather_nograd = real
            out[kind] = dict(
                on_meta=sum(g is ps.groups.etp_meta for g in seen), on_etp=sum(g is ps.groups.etp for g in seen)
            )
    return out


@pytest.mark.usefixtures("one_thread")
def test_etp_counts_on_their_own_communicator(ranks):
    for per_rank in ranks(4).run(_etp_counts_groups):
        for kind, r in per_rank.items():
            assert r["on_meta"] == 1 and r["on_etp"] == 0, (kind, r)  # the ETP count gather, off the ETP payload's
