"""Pure rank-group math for folded layouts, with Megatron-Core's ``RankGenerator`` semantics.

No ``torch.distributed`` here: everything is a function of sizes and an order string, so it can be
tested at any world size and printed by ``tools/layout.py`` without starting a process.

Algorithm
---------
An order string such as ``"tp-cp-ep-dp-pp"`` lists axes from fastest- to slowest-varying. Axis ``i``
has stride ``prod(size[j] for j < i)`` and a rank is ``sum(index_axis * stride_axis)``. A token such
as ``"tp-dp"`` selects a set of axes (the order inside the token does not matter). ``get_ranks(token)``
returns one group per combination of the *other* axes, groups enumerated in mixed-radix order over
those other axes (first one fastest); inside a group ranks are enumerated in mixed-radix order over the
selected axes (first one fastest).

Worked example (8 ranks, order ``tp-cp-ep-dp-pp``, tp=2 cp=2 dp=2): strides tp=1, cp=2, dp=4.
``get_ranks("cp")`` -> ``[[0, 2], [1, 3], [4, 6], [5, 7]]``; ``get_ranks("dp-cp")`` ->
``[[0, 2, 4, 6], [1, 3, 5, 7]]``.

Usage::

    gen = RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=2, order="tp-cp-ep-dp-pp")
    gen.get_ranks("tp")            # [[0, 1], [2, 3], [4, 5], [6, 7]]
    layout_groups(layout)          # every group a trainer needs, for both generators
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Sequence

AXES = ("tp", "cp", "ep", "dp", "pp")

#: Roles of the attention (dense) generator that a trainer needs, by token.
ATTENTION_TOKENS = ("tp", "cp", "dp", "dp-cp", "tp-cp", "tp-dp-cp", "pp", "tp-pp")
#: Roles of the expert generator that a trainer needs, by token ("tp" is ETP, "dp" is EDP).
EXPERT_TOKENS = ("tp", "ep", "dp", "tp-ep", "tp-ep-pp", "pp")


class LayoutError(ValueError):
    """An impossible layout: the message names the setting and how to fix it."""


def parse_order(order: str) -> List[str]:
    """Split and validate an order string such as ``"tp-cp-ep-dp-pp"``.

    Raises :class:`LayoutError` for an unknown or repeated axis.
    """
    if not isinstance(order, str) or not order:
        raise LayoutError(f"parallel.order must be a non-empty string like 'tp-cp-ep-dp-pp', got {order!r}")
    names = order.split("-")
    for name in names:
        if name not in AXES:
            raise LayoutError(
                f"parallel.order={order!r} names unknown axis {name!r}; allowed axes are {', '.join(AXES)}"
            )
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise LayoutError(f"parallel.order={order!r} repeats axis {dup[0]!r}; name each axis at most once")
    return names


def _mixed_radix(sizes: Sequence[int]):
    """Yield index tuples over ``sizes`` with the first position varying fastest."""
    for rev in itertools.product(*[range(s) for s in reversed(sizes)]):
        yield tuple(reversed(rev))


class RankGenerator:
    """Rank groups of one factorization of the world (Megatron-Core ``RankGenerator`` semantics).

    Args (keyword-only): ``tp, ep, dp, pp, cp`` axis sizes, and ``order``. An axis missing from the
    order must have size 1 (it is appended, as Megatron-Core does).
    """

    def __init__(self, *, tp: int, ep: int, dp: int, pp: int, cp: int, order: str):
        sizes = {"tp": tp, "ep": ep, "dp": dp, "pp": pp, "cp": cp}
        for name, size in sizes.items():
            if not isinstance(size, int) or size < 1:
                raise LayoutError(f"parallel size {name}={size!r} must be an integer >= 1")
        names = parse_order(order)
        for name in AXES:
            if name not in names:
                if sizes[name] != 1:
                    raise LayoutError(
                        f"parallel.order={order!r} omits axis {name!r} whose size is {sizes[name]}; "
                        f"add '{name}' to the order"
                    )
                names.append(name)
        self.order = names
        self.sizes = [sizes[n] for n in names]
        self.world_size = 1
        for s in self.sizes:
            self.world_size *= s
        self.strides = []
        stride = 1
        for s in self.sizes:
            self.strides.append(stride)
            stride *= s

    def get_ranks(self, token: str) -> List[List[int]]:
        """Return the rank groups of ``token`` (e.g. ``"tp"``, ``"dp-cp"``), in generator order."""
        selected = set(token.split("-"))
        unknown = selected - set(AXES)
        if unknown:
            raise LayoutError(f"unknown axis {sorted(unknown)[0]!r} in token {token!r}")
        sel = [i for i, n in enumerate(self.order) if n in selected]
        other = [i for i, n in enumerate(self.order) if n not in selected]
        groups = []
        for oidx in _mixed_radix([self.sizes[i] for i in other]):
            base = sum(j * self.strides[i] for i, j in zip(other, oidx))
            group = [
                base + sum(j * self.strides[i] for i, j in zip(sel, sidx))
                for sidx in _mixed_radix([self.sizes[i] for i in sel])
            ]
            groups.append(group)
        return groups


def node_split_groups(ep_groups: List[List[int]], nvlink_domain: Optional[int]):
    """The node and rail groups of every EP group, for the hierarchical dispatcher (pure math).

    A *node* is ``nvlink_domain`` consecutive global ranks (rank ``r`` is on node ``r // G``), the
    ranks that share the fast link. For each EP group, its *node groups* are its ranks on one node
    (in EP order) and its *rail groups* its ranks with the same position ``i`` among the group's
    ranks on their node, one per node (node order). ``nvlink_domain=None`` means one node (the
    world): the node groups are the EP groups and the rails single ranks.

    Every node an EP group touches must hold the same number ``g`` of its ranks, and they must be
    consecutive in EP order (node-major EP indices: EP index ``d = n·g + i``); otherwise the layout
    is refused naming ``parallel.nvlink_domain``. Returns ``(node_groups, rail_groups)``, each a
    list of rank lists, every rank in exactly one of each.

    Worked example (8 ranks, EP groups ``[[0, 2, 4, 6], [1, 3, 5, 7]]`` of EP4 x ETP2, G = 4):
    node groups ``[[0, 2], [4, 6], [1, 3], [5, 7]]``, rail groups ``[[0, 4], [2, 6], [1, 5], [3, 7]]``.
    """
    if nvlink_domain is None:
        return [list(g) for g in ep_groups], [[r] for g in ep_groups for r in g]
    if isinstance(nvlink_domain, bool) or not isinstance(nvlink_domain, int) or nvlink_domain < 1:
        raise LayoutError(f"parallel.nvlink_domain={nvlink_domain!r} must be an integer >= 1 (ranks per node)")
    nodes_out: List[List[int]] = []
    rails_out: List[List[int]] = []
    for grp in ep_groups:
        node_of = [r // nvlink_domain for r in grp]
        runs: List[List[int]] = []  # consecutive EP indices on one node
        for r, n in zip(grp, node_of):
            if runs and runs[-1][0] // nvlink_domain == n:
                runs[-1].append(r)
            else:
                runs.append([r])
        sizes = {len(run) for run in runs}
        if len(sizes) > 1 or len(runs) != len(set(node_of)):
            per = {n: node_of.count(n) for n in dict.fromkeys(node_of)}
            raise LayoutError(
                f"parallel.nvlink_domain={nvlink_domain}: the EP group {grp} holds "
                f"{', '.join(f'{c} rank(s) on node {n}' for n, c in per.items())}; the hierarchical "
                "dispatcher needs the same number of each EP group's ranks on every node it spans, "
                "consecutive in EP order: set parallel.nvlink_domain to the ranks per node, change "
                "parallel.ep or parallel.order, or use moe.dispatcher=alltoall"
            )
        g = len(runs[0])
        nodes_out += runs
        rails_out += [[run[i] for run in runs] for i in range(g)]
    return nodes_out, rails_out


def embedding_groups(pp_groups: List[List[int]]) -> List[List[int]]:
    """First and last rank of every pipeline group (the ranks that hold tied embeddings)."""
    return [[g[0], g[-1]] if len(g) > 1 else list(g) for g in pp_groups]


def attention_generator(layout) -> RankGenerator:
    """The dense generator of a :class:`~folding.parallel.layout.ParallelLayout`: tp, cp, dp, pp."""
    return RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order=layout.order)


def expert_generator(layout) -> RankGenerator:
    """The expert generator of a layout: etp (as tp), ep, edp (as dp), pp; cp is 1."""
    return RankGenerator(tp=layout.etp, ep=layout.ep, dp=layout.edp, pp=layout.pp, cp=1, order=layout.order)


def layout_groups(layout) -> Dict[str, Dict[str, List[List[int]]]]:
    """Every group a trainer needs, for both generators, keyed like ``tools/layout.py --json``.

    ``{"attention": {"tp", "cp", "dp", "dp-cp", "tp-cp", "tp-dp-cp", "pp", "tp-pp", "embedding"},
    "expert": {"tp", "ep", "dp", "tp-ep", "tp-ep-pp", "pp", "ep-node", "ep-rail"}}``; the last two
    split the EP groups by node (:func:`node_split_groups`, ``layout.nvlink_domain``).
    """
    att = attention_generator(layout)
    exp = expert_generator(layout)
    out = {
        "attention": {t: att.get_ranks(t) for t in ATTENTION_TOKENS},
        "expert": {t: exp.get_ranks(t) for t in EXPERT_TOKENS},
    }
    out["attention"]["embedding"] = embedding_groups(out["attention"]["pp"])
    node, rail = node_split_groups(out["expert"]["ep"], layout.nvlink_domain)
    out["expert"]["ep-node"], out["expert"]["ep-rail"] = node, rail
    return out
