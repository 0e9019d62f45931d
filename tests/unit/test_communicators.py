"""A communicator per concurrent role (``build_parallel_state(own_communicators=True)``), checked over a
grid of layouts without creating a process group.

NCCL runs one communicator's operations in issue order, so two roles on one communicator wait for each
other. With the rule on, a role of ``CONCURRENT_ROLES`` (work in flight while the other lane of an
overlap pair runs) shares its communicator with no role outside its queue, even where the ranks are
the same; with it off, roles share by ranks as they always did (the count groups ``ep_meta`` /
``etp_meta`` apart). ``build_parallel_state`` itself runs here, on every rank of each layout, against a
stand-in for ``torch.distributed`` that records the groups it is asked to create: the checks are on the
group objects every role gets and on the creation order, which must be the same on every rank
(``new_group`` is collective over the world).
"""

import itertools
import types

import pytest

import folding.parallel.state as state_mod
from folding.parallel.layout import ParallelLayout
from folding.parallel.rank_math import LayoutError
from folding.parallel.state import CONCURRENT_ROLES, OWN_COMMUNICATOR, ROLES, build_parallel_state


class _Group:
    def __init__(self, ranks):
        self.ranks = tuple(ranks)


class _FakeDist:
    """The part of ``torch.distributed`` that ``build_parallel_state`` calls, for one rank of a world."""

    def __init__(self, world: int, rank: int):
        self.world, self.rank = world, rank
        self.group = types.SimpleNamespace(WORLD=_Group(range(world)))
        self.created = []  # the rank lists of new_group, in call order

    def is_initialized(self):
        return True

    def get_world_size(self):
        return self.world

    def get_rank(self):
        return self.rank

    def new_group(self, ranks, **kwargs):
        self.created.append(tuple(ranks))
        return _Group(ranks)

    def barrier(self):
        pass


def _build(monkeypatch, layout, rank, own):
    fake = _FakeDist(layout.world_size, rank)
    monkeypatch.setattr(state_mod, "dist", fake)
    ps = build_parallel_state(layout, own_communicators=own)
    return ps, fake.created


def _grid():
    """Flat and hierarchical layouts of 8 to 32 ranks mixing TP, CP, EP, ETP, PP (and an axis order)."""
    out = []
    for world, tp, cp, pp, ep, etp, node in itertools.product(
        (8, 16, 32), (1, 2, 4, 8), (1, 2), (1, 2), (1, 2, 4, 8, 16), (1, 2), (None, 4, 8)
    ):
        try:
            lay = ParallelLayout(world_size=world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, nvlink_domain=node)
        except LayoutError:
            continue
        out.append(lay)
    out.append(ParallelLayout(world_size=16, tp=2, ep=4, etp=1, order="tp-ep-cp-dp-pp", nvlink_domain=4))
    return out[::5] + out[-1:]  # every fifth (coprime to every axis length): each kind of layout stays in


GRID = _grid()


def _ranks_to_check(world):
    return range(world) if world <= 8 else sorted({0, 1, world // 2 + 1, world - 1})


def _shared_pairs(ps):
    """The pairs of roles (of more than one rank) that this rank's state puts on one group object."""
    roles = [r for r, _, _ in ROLES if getattr(ps.coords, r).size > 1]
    return {(a, b) for a, b in itertools.combinations(roles, 2) if getattr(ps.groups, a) is getattr(ps.groups, b)}


def _may_share(a, b):
    """The rule: roles of one queue may share; a listed role shares with no role outside its queue."""
    qa, qb = CONCURRENT_ROLES.get(a), CONCURRENT_ROLES.get(b)
    return qa == qb and a not in OWN_COMMUNICATOR and b not in OWN_COMMUNICATOR


def test_the_grid_covers_flat_and_hierarchical_layouts_of_every_kind():
    assert len(GRID) > 60
    assert sum(any(len(g) > 1 for g in lay.groups()["expert"]["ep-rail"]) for lay in GRID) >= 5  # hierarchical
    for field in ("tp", "cp", "pp", "ep", "etp"):
        assert {getattr(lay, field) for lay in GRID} >= {1, 2}, field


@pytest.mark.parametrize("own", [True, False], ids=["rule on", "rule off"])
def test_roles_share_communicators_only_as_the_rule_allows_on_a_grid_of_layouts(monkeypatch, own):
    for lay in GRID:
        orders = set()
        for rank in _ranks_to_check(lay.world_size):
            ps, created = _build(monkeypatch, lay, rank, own)
            orders.add(tuple(created))
            shared = _shared_pairs(ps)
            for role, _, _ in ROLES:  # each role's group has the ranks of the math
                coord = getattr(ps.coords, role)
                if coord.size:
                    assert getattr(ps.groups, role).ranks == coord.ranks, (lay.describe(), role)
            for a, b in itertools.combinations([r for r, _, _ in ROLES], 2):
                ca, cb = getattr(ps.coords, a), getattr(ps.coords, b)
                if ca.size < 2 or ca.ranks != cb.ranks:
                    continue  # different ranks are always different groups (checked above)
                if own:
                    assert ((a, b) in shared) == _may_share(a, b), (lay.describe(), rank, a, b)
                else:  # as before the rule: same ranks, same group, but for the count groups
                    apart = a in OWN_COMMUNICATOR or b in OWN_COMMUNICATOR
                    assert ((a, b) in shared) == (not apart), (lay.describe(), rank, a, b)
        assert len(orders) == 1, lay.describe()  # every rank creates the same groups in the same order


def _roles_with(ps, role):
    """The roles (of more than one rank) on the same group object as ``role``."""
    g = getattr(ps.groups, role)
    return {r for r, _, _ in ROLES if getattr(ps.coords, r).size > 1 and getattr(ps.groups, r) is g}


def test_the_issues_examples(monkeypatch):
    """TP8 EP8 on 8 ranks; 16 ranks TP2 EP8 ETP2; hierarchical TP8 EP16 over 2 nodes of 8: the roles that
    share with the token exchanges' groups before the rule, and after it."""
    flat8 = ParallelLayout(world_size=8, tp=8, ep=8, etp=1)
    ps, _ = _build(monkeypatch, flat8, 0, False)
    assert _roles_with(ps, "ep") >= {"ep", "ep_node", "tp", "tp_cp", "tp_dp_cp"}
    ps, _ = _build(monkeypatch, flat8, 0, True)
    assert _roles_with(ps, "ep") == {"ep", "ep_node"}  # ep_node: the same queue (one node: unused)
    assert _roles_with(ps, "tp") == {"tp"} and _roles_with(ps, "tp_cp") == {"tp_cp", "tp_dp_cp"}

    mixed16 = ParallelLayout(world_size=16, tp=2, ep=8, etp=2)
    ps, _ = _build(monkeypatch, mixed16, 0, False)
    assert "tp" in _roles_with(ps, "etp") and "dp_cp" in _roles_with(ps, "ep")
    ps, _ = _build(monkeypatch, mixed16, 0, True)
    assert _roles_with(ps, "etp") == {"etp"} and _roles_with(ps, "ep") == {"ep", "ep_node"}
    assert _roles_with(ps, "dp_cp") == {"dp", "dp_cp"}

    hier = ParallelLayout(world_size=16, tp=8, ep=16, etp=1, nvlink_domain=8)
    ps, _ = _build(monkeypatch, hier, 0, False)
    assert "dp_cp" in _roles_with(ps, "ep_rail") and "tp" in _roles_with(ps, "ep_node")
    ps, _ = _build(monkeypatch, hier, 0, True)
    assert _roles_with(ps, "ep_rail") == {"ep_rail"} and _roles_with(ps, "ep_node") == {"ep_node"}
    assert ps.groups.ep is not ps.groups.tp_dp_cp and ps.groups.ep is not state_mod.dist.group.WORLD


def test_communicator_keys_at_sizes_never_built_here():
    """The pure keying at 1,024 ranks (DeepSeek-V3's layout of docs/planner.md, hierarchical over nodes
    of 8): no key of a listed role is shared outside its queue."""
    lay = ParallelLayout(world_size=1024, tp=2, pp=8, ep=64, etp=1, nvlink_domain=8)
    holders = {}
    for role, groups in state_mod.communicator_keys(lay, True).items():
        for ranks, key in groups:
            if len(ranks) > 1:
                holders.setdefault(key, set()).add(role)
    for key, roles in holders.items():
        for a, b in itertools.combinations(sorted(roles), 2):
            assert _may_share(a, b), (key, roles)
    assert len(holders) > len(state_mod.communicator_keys(lay, True)["ep"])
