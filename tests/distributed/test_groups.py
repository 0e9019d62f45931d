"""Process groups on 8 gloo ranks match the rank math, checked with real collectives; collectives'
forward and backward match their single-process definitions."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from folding.parallel import ParallelLayout, build_parallel_state
from folding.parallel import collectives as C
from folding.parallel.groups import Coordinates, GroupCoord, ProcessGroups
from folding.parallel.state import ROLES, ParallelState
from tests import reference_collectives as R

LAYOUTS = [
    dict(tp=2, cp=2, ep=8, etp=1),  # the README's worked example
    dict(tp=2, ep=4, etp=2),
    dict(cp=2, ep=4, etp=1),
    dict(tp=4, ep=2, etp=1),
    dict(tp=2, pp=2, ep=2, etp=1),
    dict(pp=2, ep=4, etp=1, vpp=2),
    dict(tp=2, cp=2, pp=2, ep=4, etp=1),
    dict(tp=2, ep=2, etp=1, order="tp-ep-cp-dp-pp"),
]


def test_every_role_is_a_declared_field_of_both_records():
    """The group record and the coordinates record have one field per role, and the state one field
    for each record: declared on the classes (visible to IDEs and type checkers), none synthesized on
    lookup."""
    roles = [role for role, _, _ in ROLES]
    assert [f.name for f in dataclasses.fields(ProcessGroups)] == roles
    assert [f.name for f in dataclasses.fields(Coordinates)] == roles
    assert all(f.type in (GroupCoord, "GroupCoord") for f in dataclasses.fields(Coordinates))
    state_fields = {f.name: f.type for f in dataclasses.fields(ParallelState)}
    assert state_fields["groups"] in (ProcessGroups, "ProcessGroups")
    assert state_fields["coords"] in (Coordinates, "Coordinates")
    for cls in (ParallelState, ProcessGroups, Coordinates):
        assert "__getattr__" not in vars(cls), cls
    assert ProcessGroups.single() == ProcessGroups()  # no torch.distributed job here: every group None


def _single_record_in_a_job():
    try:
        ProcessGroups.single()
    except ValueError as e:
        return str(e)
    return None


def test_the_one_rank_record_is_refused_in_a_job_of_several_ranks(ranks):
    """Inside a 2-rank job a record of ``None`` groups would mean the world: refused, naming the fix."""
    assert all("pass parallel_state=" in (msg or "") for msg in ranks(2).run(_single_record_in_a_job))


def _check_groups(layout_kwargs):
    layout = ParallelLayout(world_size=dist.get_world_size(), **layout_kwargs)
    ps = build_parallel_state(layout)
    rank = dist.get_rank()
    table = layout.groups()
    seen = {}
    try:
        for role, view, token in ROLES:
            expected = [g for g in table[view][token] if rank in g]
            group = getattr(ps.groups, role)
            coord = getattr(ps.coords, role)
            if not expected:
                assert group is None and role == "embedding"
                assert coord.ranks == () and coord.rank is None and coord.size == 0
                continue
            expected = expected[0]
            # A real all-gather of the global ranks inside the group must give the math's list.
            t = torch.tensor([rank], dtype=torch.int64)
            out = torch.zeros(len(expected), dtype=torch.int64)
            dist.all_gather_into_tensor(out, t, group=group)
            seen[role] = out.tolist()
            assert out.tolist() == expected, (role, out.tolist(), expected)
            assert coord.ranks == tuple(expected)
            assert coord.rank == expected.index(rank)
            assert coord.size == len(expected)
        # the EP ranks' metadata group: the same ranks on a communicator of its own (NCCL orders each)
        assert (ps.groups.ep_meta is not ps.groups.ep) == (ps.coords.ep.size > 1)
    finally:
        ps.destroy()
    return seen


@pytest.mark.parametrize("layout_kwargs", LAYOUTS, ids=lambda k: "-".join(f"{a}{b}" for a, b in k.items()))
def test_groups_match_math(ranks, layout_kwargs):
    seen = ranks(8).run(_check_groups, layout_kwargs)
    layout = ParallelLayout(world_size=8, **layout_kwargs)
    # every rank's view assembles to exactly the math's partition
    for role, view, token in ROLES:
        got = sorted({tuple(s[role]) for s in seen if role in s})
        assert got == sorted(tuple(g) for g in layout.groups()[view][token]), role


def _collectives_match(seed):
    """Each collective (the engine's, and the tests' reference ones) against its definition computed
    from all ranks' full inputs."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(world * 2, 3, generator=g, dtype=torch.float64) for _ in range(world)]
    gs = [torch.randn(world * 2, 3, generator=g, dtype=torch.float64) for _ in range(world)]
    out = {}

    def run(fn, x, grad):
        x = x.clone().requires_grad_(True)
        y = fn(x)
        y.backward(grad[: y.shape[0], : y.shape[1]] if grad.shape != y.shape else grad)
        return y.detach(), x.grad

    def close(a, b):
        assert torch.allclose(a, b, atol=1e-12), (a, b)

    # reduce_from_region: forward sum, backward identity
    y, gx = run(lambda x: R.reduce_from_region(x, None), xs[rank], gs[rank])
    close(y, sum(xs))
    close(gx, gs[rank])
    # all_gather_nograd: concatenated on dim 0, or stacked on a new leading dim
    close(C.all_gather_nograd(xs[rank], None), torch.cat(xs))
    close(C.all_gather_nograd(xs[rank], None, stack=True), torch.stack(xs))
    # gather_from_sequence_region: forward concat on dim 0, backward reduce-scatter
    gfull = [
        torch.randn(world * world * 2, 3, generator=torch.Generator().manual_seed(seed + r), dtype=torch.float64)
        for r in range(world)
    ]
    y, gx = run(lambda x: C.gather_from_sequence_region(x, None), xs[rank], gfull[rank])
    close(y, torch.cat(xs))
    close(gx, sum(gfull).chunk(world)[rank])
    # reduce_scatter_to_sequence_region: forward sum then chunk, backward all-gather
    y, gx = run(lambda x: C.reduce_scatter_to_sequence_region(x, None), xs[rank], gs[rank][:2])
    close(y, sum(xs).chunk(world)[rank])
    close(gx, torch.cat([gg[:2] for gg in gs]))
    # gather_from_region on the last dim, backward split
    y, gx = run(lambda x: R.gather_from_region(x, None), xs[rank], torch.cat([gs[rank]] * world, dim=1))
    close(y, torch.cat(xs, dim=1))
    close(gx, gs[rank])
    # all_to_all with uneven splits: rank r sends (r + d + 1) rows to rank d
    send = [[r + d + 1 for d in range(world)] for r in range(world)]
    rows = [torch.arange(sum(send[r]), dtype=torch.float64).unsqueeze(1) + 100 * r for r in range(world)]
    recv = [send[s][rank] for s in range(world)]
    x = rows[rank].clone().requires_grad_(True)
    y = R.all_to_all(x, None, recv, send[rank])
    exp = torch.cat([rows[s].split(send[s])[rank] for s in range(world)])
    close(y.detach(), exp)
    (y * (rank + 1)).sum().backward()
    exp_grad = torch.cat([torch.full((send[rank][d], 1), float(d + 1), dtype=torch.float64) for d in range(world)])
    close(x.grad, exp_grad)
    # all_gather_v / reduce_scatter_v with uneven sizes
    sizes = [r + 1 for r in range(world)]
    parts = [torch.full((sizes[r], 2), float(r), dtype=torch.float64) for r in range(world)]
    x = parts[rank].clone().requires_grad_(True)
    y = R.all_gather_v(x, None, sizes)
    close(y.detach(), torch.cat(parts))
    (y * (rank + 1)).sum().backward()
    close(x.grad, torch.full_like(x, float(sum(range(1, world + 1)))))
    full = torch.arange(sum(sizes) * 2, dtype=torch.float64).view(-1, 2)
    x = (full * (rank + 1)).requires_grad_(True)
    y = R.reduce_scatter_v(x, None, sizes)
    close(y.detach(), (full * sum(range(1, world + 1))).split(sizes)[rank])
    y.sum().backward()
    close(x.grad, torch.ones_like(full))
    out["ok"] = True
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_collectives(ranks, world):
    assert all(r["ok"] for r in ranks(world).run(_collectives_match, 7))


def _timed_build_and_destroy(delay_s):
    """Rank 0 arrives ``delay_s`` late at both creation and destruction; every rank records when it
    got there and when it returned (the monotonic clock is shared by the processes of one host)."""
    import time

    late = dist.get_rank() == 0
    if late:
        time.sleep(delay_s)
    t_build = time.monotonic()
    ps = build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), tp=2, ep=2, etp=1))
    t_built = time.monotonic()
    if late:
        time.sleep(delay_s)
    t_destroy = time.monotonic()
    ps.destroy()
    return t_build, t_built, t_destroy, time.monotonic()


def test_groups_are_connected_everywhere_before_use_and_torn_down_together(ranks):
    """No rank returns from build_parallel_state before the slowest rank has started creating the
    groups, nor from destroy before every rank has finished using them: gloo finishes a pair's
    handshake at different times on its two ends, and a group closed under a peer still connecting
    fails that peer ("Connection closed by peer")."""
    out = ranks(4).run(_timed_build_and_destroy, 1.0)
    slow_build, slow_destroy = out[0][0], out[0][2]
    for rank, (_, built, _, destroyed) in enumerate(out):
        assert built >= slow_build, f"rank {rank} returned from build before rank 0 started it"
        assert destroyed >= slow_destroy, f"rank {rank} destroyed its groups before rank 0 was done"


def _fail_on_rank_one_after_build():
    with build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), tp=2, ep=2, etp=1)):
        if dist.get_rank() == 1:
            raise ValueError("boom after the groups were built")
    return dist.get_rank()


def test_destroy_on_an_error_path_does_not_wait_for_peers(ranks):
    """A rank leaving the groups' scope by an exception tears them down without the barrier (its
    peers may never arrive), so its traceback reaches the caller instead of a hang."""
    from folding.testing import RankFailure

    with pytest.raises(RankFailure, match="boom after the groups were built"):
        ranks(4).run(_fail_on_rank_one_after_build, timeout_s=60)


def _node_split_per_layer(layers_per_stage, nvlink_domain=1):
    """Build one hierarchical dispatcher per MoE layer of this rank's stage (``layers_per_stage[pp
    rank]`` of them), each given ``nvlink_domain`` alone, as ``replace_dispatcher`` does per layer;
    count the groups created (``dist.new_group``, collective over the world). Then ask for another
    ``nvlink_domain``, which must be refused without any collective. The rank pool releases the
    groups (``release_shared_node_split_groups``) when the task ends."""
    from folding.moe.dispatch.build import build_dispatcher

    ps = build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), pp=2, ep=2, etp=1))
    made, real = [], dist.new_group

    def counting(*args, **kwargs):
        made.append(args[0] if args else kwargs.get("ranks"))
        return real(*args, **kwargs)

    kw = dict(num_experts=4, topk=2, ep_group=ps.groups.ep, etp_group=ps.groups.etp)
    dist.new_group = counting
    try:
        layers = [
            build_dispatcher("hierarchical", nvlink_domain=nvlink_domain, **kw)
            for _ in range(layers_per_stage[ps.coords.pp.rank])
        ]
        shared = all(d.rail_group is layers[0].rail_group and d.node_group is layers[0].node_group for d in layers)
        try:
            build_dispatcher("hierarchical", nvlink_domain=nvlink_domain + 1, **kw)
            refused = ""
        except ValueError as err:
            refused = str(err)
    finally:
        dist.new_group = real
    ps.destroy()
    return len(made), shared, type(layers[0]).__name__, refused


def test_node_and_rail_groups_are_built_once_per_process(ranks):
    """``nvlink_domain`` alone: the node and rail groups are created by the first dispatcher of the
    process and shared by every later one, so a stage with 2 MoE layers creates as many world-wide
    groups as a stage with 1 (it used to create them once per layer: the stages then issued
    different numbers of world collectives and hung at build). A second set of sizes is refused."""
    from folding.parallel.rank_math import node_split_groups

    ep_groups = ParallelLayout(world_size=4, pp=2, ep=2, etp=1).groups()["expert"]["ep"]
    node, rail = node_split_groups(ep_groups, 1)
    once = len(node) + len(rail)  # one build: every node and rail group of the world, each a new_group
    for made, shared, kind, refused in ranks(4).run(_node_split_per_layer, (2, 2)):
        assert made == once, (
            f"{made} world-wide groups created (2 layers, then another nvlink_domain); one build creates {once}"
        )
        assert kind == "HierarchicalDispatcher" and shared
        assert "already built" in refused and "nvlink_domain=2" in refused and "node_group=" in refused, refused
    # stages with different numbers of MoE layers: the same world collectives on every rank, no hang
    assert [r[0] for r in ranks(4).run(_node_split_per_layer, (1, 2), timeout_s=120)] == [once] * 4


def _own_communicators():
    """TP2 EP4 ETP1 on 4 ranks built without and with ``own_communicators``: which roles share a group,
    and an all-reduce of ones on every role's group (each a working group of its ranks)."""
    layout = ParallelLayout(world_size=dist.get_world_size(), tp=2, ep=4, etp=1)
    out = {}
    for own in (False, True):
        with build_parallel_state(layout, own_communicators=own) as ps:
            g = ps.groups
            sums = {}
            for role, _, _ in ROLES:
                t = torch.ones(1)
                dist.all_reduce(t, group=getattr(g, role))
                sums[role] = (int(t.item()), getattr(ps.coords, role).size)
            out[own] = dict(
                ep_is_world=g.ep is dist.group.WORLD,
                ep_with_tp_dp_cp=g.ep is g.tp_dp_cp,
                ep_with_ep_node=g.ep is g.ep_node,
                tp_with_tp_cp=g.tp is g.tp_cp,
                dp_with_dp_cp=g.dp is g.dp_cp,
                meta_apart=g.ep_meta is not g.ep,
                sums=sums,
            )
    return out


def test_own_communicators_give_concurrent_roles_groups_of_their_own(ranks):
    """With the rule, ``ep`` (the world's ranks here) is a group of its own, apart from ``tp_dp_cp`` and
    the world group, and ``tp`` apart from ``tp_cp`` (the same two ranks); roles of one queue
    (``ep``/``ep_node``, ``dp``/``dp_cp``) still share. Without it, the ranks decide, as before."""
    for out in ranks(4).run(_own_communicators):
        off, on = out[False], out[True]
        assert off["ep_is_world"] and off["ep_with_tp_dp_cp"] and off["tp_with_tp_cp"], off
        assert not on["ep_is_world"] and not on["ep_with_tp_dp_cp"] and not on["tp_with_tp_cp"], on
        assert on["ep_with_ep_node"] and on["dp_with_dp_cp"] and on["meta_apart"], on
        for sums in (off["sums"], on["sums"]):
            assert all(total == size for total, size in sums.values()), sums
