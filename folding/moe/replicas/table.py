"""Hot-expert replicas (``moe.expert_replicas``): the slot table, its planner and the token split.

Every EP rank holds its ``L`` owned experts and ``R`` replica slots (``R = moe.expert_replicas``);
the ``EP·(L+R)`` *slots* are numbered rank-major, ``slot = ep_rank·(L+R) + j``: ``j < L`` is the
owned expert ``ep_rank·L + j``, ``j >= L`` the replica slot ``j − L`` of that rank. The *slot table*
(a tuple of ``EP·R`` ints, identical on every rank; ``-1`` = empty) names the logical expert each
replica slot computes. Nothing else about an expert changes: routing, top-k and capacity dropping
decide on logical experts; :func:`split_to_slots` then hands each kept (token, expert) pair of a
replicated expert to one of its copies, and the dispatcher moves rows by slot (it is built with
``EP·(L+R)`` "experts" of which ``L+R`` are local). Replica weights are fetched from their owners
each forward (:mod:`folding.moe.replicas.fetch`), so they are never parameters.

- :func:`plan_replicas`: the table from measured per-expert loads (greedy, deterministic ties).
- :func:`expert_copies`: each replicated expert's copies, owner first.
- :func:`split_to_slots`: the logical routing map and probabilities ``[T, E]`` → slots ``[T, Es]``.
- :class:`IndexCache`: a layer's index tensors of its current table, kept on the device.
- :class:`ReplicaSchedule`: the trainer's re-plan every ``moe.replica_interval`` steps.

Shape suffixes (docs/shapes.md): ``T`` local tokens, ``E`` global experts, ``Es`` expert slots ``EP·(L+R)``,
``Er`` the experts with a replica, ``Ec`` all copies of those (owner slots included).

Usage::

    table = plan_replicas(load_E, ep_size=4, num_local_experts=4, num_replicas=2)
    map_TEs, probs_TEs = split_to_slots(map_TE, probs_TE, table, ep_size=4, num_local_experts=4, num_replicas=2)
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

EMPTY = -1
"""The slot-table entry of an empty replica slot."""


def empty_table(ep_size: int, num_replicas: int) -> Tuple[int, ...]:
    """The table with every replica slot empty (the state before the first plan, and at resume)."""
    return (EMPTY,) * (ep_size * num_replicas)


def check_replica_layout(config, ep_size: int) -> None:
    """Raise ``ValueError`` naming the setting unless ``config.expert_replicas`` fits an EP group of
    ``ep_size`` ranks (EP > 1, experts divisible by EP). Runs before any collective."""
    R = config.expert_replicas
    if R and ep_size < 2:
        raise ValueError(
            f"moe.expert_replicas={R} needs expert parallelism (EP > 1), but parallel.ep={ep_size}: every "
            "expert is already on every rank; set moe.expert_replicas=0 or parallel.ep > 1"
        )
    if config.num_experts % ep_size:
        raise ValueError(
            f"moe.num_experts={config.num_experts} is not divisible by EP={ep_size}; choose parallel.ep "
            f"among the divisors of {config.num_experts}"
        )


def check_table(table: Sequence[int], *, ep_size: int, num_local_experts: int, num_replicas: int) -> None:
    """Raise ``ValueError`` unless ``table`` is a valid slot table: ``EP·R`` entries, each ``-1`` or an
    expert not owned by the slot's rank, no expert twice on one rank."""
    E = ep_size * num_local_experts
    if len(table) != ep_size * num_replicas:
        raise ValueError(f"slot table has {len(table)} entries, expected EP*R = {ep_size}*{num_replicas}")
    for r in range(ep_size):
        held = [e for e in table[r * num_replicas : (r + 1) * num_replicas] if e != EMPTY]
        for e in held:
            if not 0 <= e < E:
                raise ValueError(f"slot table entry {e} on EP rank {r} is not an expert in [0, {E})")
            if e // num_local_experts == r:
                raise ValueError(f"slot table puts a replica of expert {e} on its owner, EP rank {r}")
        if len(set(held)) != len(held):
            raise ValueError(f"slot table holds an expert twice on EP rank {r}: {held}")


def expert_copies(
    table: Sequence[int], *, ep_size: int, num_local_experts: int, num_replicas: int
) -> Dict[int, List[int]]:
    """``{expert: [owner slot, replica slots ascending]}`` for every expert with at least one replica."""
    L, R = num_local_experts, num_replicas
    copies: Dict[int, List[int]] = {}
    for i, e in enumerate(table):
        if e == EMPTY:
            continue
        r, j = divmod(i, R)
        copies.setdefault(e, [(e // L) * (L + R) + e % L]).append(r * (L + R) + L + j)
    return copies


def plan_replicas(
    load_E: Sequence[float], *, ep_size: int, num_local_experts: int, num_replicas: int
) -> Tuple[int, ...]:
    """The slot table for per-expert loads ``load_E`` (token counts summed over all ranks).

    Greedy, one replica at a time while a slot is free: on the most loaded EP rank (projected load:
    the sum of the shares ``load/copies`` of the copies it holds; ties: lower rank), consider each
    expert it holds a copy of; a new copy of expert ``e`` goes to the least loaded rank (ties: lower
    rank) that has a free slot and no copy of ``e``, and every copy's share becomes
    ``load/(copies+1)``. Take the candidate whose resulting rank loads, sorted from the largest, are
    smallest (ties: lower expert index), if they are smaller than now (sorted vectors compared
    lexicographically: the peak drops, or stays while fewer ranks sit at it); stop when none is (a
    balanced load gets no replica). Pure and deterministic: every rank given the same loads computes the same table.
    """
    L, R = num_local_experts, num_replicas
    E = ep_size * L
    if len(load_E) != E:
        raise ValueError(f"load_E has {len(load_E)} entries, expected num_experts = EP*L = {E}")
    load = [float(x) for x in load_E]
    holders: List[List[int]] = [[e // L] for e in range(E)]  # EP ranks holding a copy, owner first
    free = [R] * ep_size
    table = [EMPTY] * (ep_size * R)
    while any(free):
        loads = [0.0] * ep_size
        for e in range(E):
            for r in holders[e]:
                loads[r] += load[e] / len(holders[e])
        now = sorted(loads, reverse=True)
        p = loads.index(now[0])
        best = None
        for e in (e for e in range(E) if p in holders[e] and load[e] > 0):
            targets = [r for r in range(ep_size) if free[r] and r not in holders[e]]
            if not targets:
                continue
            r = min(targets, key=lambda r: (loads[r], r))
            share, old = load[e] / (len(holders[e]) + 1), load[e] / len(holders[e])
            new = list(loads)
            for h in holders[e]:
                new[h] -= old - share
            new[r] += share
            key = (sorted(new, reverse=True), e)
            if key[0] < now and (best is None or key < best[0]):
                best = (key, e, r)
        if best is None:
            break
        _, e, r = best
        table[r * R + (R - free[r])] = e
        free[r] -= 1
        holders[e].append(r)
    return tuple(table)


def projected_rank_loads(
    load_E: Sequence[float], table: Sequence[int], *, ep_size: int, num_local_experts: int, num_replicas: int
) -> List[float]:
    """Each EP rank's tokens when every copy of an expert takes an equal share of its load."""
    L = num_local_experts
    holders: List[List[int]] = [[e // L] for e in range(len(load_E))]
    for i, e in enumerate(table):
        if e != EMPTY:
            holders[e].append(i // num_replicas)
    out = [0.0] * ep_size
    for e, hs in enumerate(holders):
        for r in hs:
            out[r] += float(load_E[e]) / len(hs)
    return out


def table_summary(
    load_E: Sequence[float], table: Sequence[int], *, ep_size: int, num_local_experts: int, num_replicas: int
) -> Dict:
    """What slot table ``table`` does to per-expert loads ``load_E``: ``{"table": [EP·R ints],
    "copies": {"e": [EP ranks holding a replica of expert e]}, "max_over_mean": the EP ranks' busiest
    load over their mean with the table (each copy an equal share), "max_over_mean_without": the same
    without replicas}`` (JSON-ready; ratios 1.0 for an all-zero load)."""
    geo = dict(ep_size=ep_size, num_local_experts=num_local_experts, num_replicas=num_replicas)
    copies: Dict[str, List[int]] = {}
    for i, e in enumerate(table):
        if e != EMPTY:
            copies.setdefault(str(e), []).append(i // num_replicas)

    def ratio(t) -> float:
        loads = projected_rank_loads(load_E, t, **geo)
        mean = sum(loads) / len(loads)
        return round(max(loads) / mean, 4) if mean > 0 else 1.0

    return {
        "table": [int(e) for e in table],
        "copies": {e: sorted(r) for e, r in sorted(copies.items(), key=lambda kv: int(kv[0]))},
        "max_over_mean": ratio(table),
        "max_over_mean_without": ratio(empty_table(ep_size, num_replicas)),
    }


def slot_experts(table: Sequence[int], *, ep_size: int, num_local_experts: int, num_replicas: int) -> List[int]:
    """The logical expert of every slot ``[S]`` (``-1`` for an empty replica slot)."""
    L, R = num_local_experts, num_replicas
    out = []
    for r in range(ep_size):
        out += [r * L + j for j in range(L)] + list(table[r * R : (r + 1) * R])
    return out


def split_to_slots(
    routing_map_TE: torch.Tensor,
    probs_TE: torch.Tensor,
    table: Sequence[int],
    *,
    ep_size: int,
    num_local_experts: int,
    num_replicas: int,
    cache: Optional["IndexCache"] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The routing map and probabilities per slot: ``(map_TEs, probs_TEs)``.

    Each kept pair of an unreplicated expert goes to its owned slot. The pairs of a replicated expert
    with ``k`` copies are split, in token order, into ``k`` contiguous near-equal parts (pair number
    ``i`` of ``n`` goes to copy ``floor(i·k/n)``, owner first): deterministic, local, no host sync.
    ``probs_TEs[:, s]`` is the probability of the slot's expert (the map decides which entries count).
    ``cache``: the layer's :class:`IndexCache`, which keeps the table's index tensors on the device
    until the table changes (without one they are copied from the host on every call).
    """
    T = routing_map_TE.shape[0]
    L, R = num_local_experts, num_replicas
    key = (tuple(table), ep_size, L, R, probs_TE.device)
    cols, rep = _slot_plan(*key) if cache is None else cache.get(key, lambda: _slot_plan(*key))
    probs_TEs = probs_TE.index_select(1, cols)
    owned = routing_map_TE.reshape(T, ep_size, L)
    spare = routing_map_TE.new_zeros((T, ep_size, R))
    map_TEs = torch.cat([owned, spare], dim=2).reshape(T, ep_size * (L + R))
    if rep is None:
        return map_TEs, probs_TEs
    experts_Er, k_Er, slots_Ec, expert_of_Ec, copy_of_Ec = rep  # Er: replicated experts, Ec: all their copies
    col_TEr = routing_map_TE.index_select(1, experts_Er)
    n_Er = col_TEr.sum(0).clamp(min=1)
    part_TEr = ((col_TEr.long().cumsum(0) - 1) * k_Er).div(n_Er, rounding_mode="floor")
    sel_TEc = col_TEr.index_select(1, expert_of_Ec) & (part_TEr.index_select(1, expert_of_Ec) == copy_of_Ec)
    map_TEs.index_copy_(1, slots_Ec, sel_TEc)
    return map_TEs, probs_TEs


class IndexCache:
    """The index tensors one MoE layer builds from its slot table, kept on the device until the table
    changes (every ``moe.replica_interval`` steps, not per forward): each layer holds its own (the
    layer's for :func:`split_to_slots`, its :class:`~folding.moe.replicas.fetch.ReplicaWeights`' for
    the fetch and the return), so a model with any number of MoE layers builds each table's tensors
    once, one host→device copy per table and not one per layer call. It keeps the latest key only:
    a layer uses one table at a time."""

    def __init__(self) -> None:
        self._key = None
        self._value = None

    def get(self, key, build):
        """``build()`` for ``key`` (a tuple: the table and what else the tensors depend on), built
        once and returned again while the key stays the same."""
        if self._value is None or self._key != key:
            self._value, self._key = build(), key
        return self._value


def _slot_plan(table: Tuple[int, ...], ep_size: int, L: int, R: int, device: torch.device):
    """The slot→expert columns ``[S]`` on ``device`` and, when some expert has a replica, the index
    tensors of the split: the replicated experts ``[Er]``, their copy counts ``[Er]``, and for each of
    their copies ``[Ec]`` its slot, the position of its expert in ``[Er]`` and its copy number (owner 0).
    Kept by the layer's :class:`IndexCache` (no host→device copy per layer call)."""
    experts = slot_experts(table, ep_size=ep_size, num_local_experts=L, num_replicas=R)
    cols = torch.tensor([max(e, 0) for e in experts], dtype=torch.long, device=device)
    copies = sorted(expert_copies(table, ep_size=ep_size, num_local_experts=L, num_replicas=R).items())
    if not copies:
        return cols, None
    slots, expert_of, copy_of = [], [], []
    for x, (_, held) in enumerate(copies):
        for j, s in enumerate(held):
            slots.append(s)
            expert_of.append(x)
            copy_of.append(j)

    def t(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    rep = (t([e for e, _ in copies]), t([len(h) for _, h in copies]), t(slots), t(expert_of), t(copy_of))
    return cols, rep


class ReplicaSchedule:
    """Re-plans the slot tables of MoE layers every ``interval`` steps from the loads they measured.

    ``observe(counts)`` after each step adds that step's per-expert counts (``{layer_number: [E]}``,
    already summed over every rank, so the same on all of them); every ``interval``-th call plans each
    layer from the counts of the interval (:func:`plan_replicas`), installs the tables with
    ``layer.set_replica_table``, starts a new interval and returns one record per layer saying what
    the re-plan did. ``summary(counts)`` describes the tables in use for one step's counts. No
    collective of its own.
    """

    def __init__(self, layers: Sequence, *, interval: int):
        """``layers``: the :class:`~folding.moe.layer.MoELayer` s of this rank with replicas on."""
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"moe.replica_interval={interval!r} must be an integer >= 1; set e.g. 100")
        self.layers = list(layers)
        self.interval = interval
        self.steps = 0
        self.loads: Dict[int, torch.Tensor] = {}

    def observe(self, counts_by_layer: Dict[int, Sequence[float]]) -> List[Dict]:
        """Add one step's counts; on every ``interval``-th step re-plan. Returns the re-plan's records,
        one per layer (none when it did not re-plan): ``{"layer", "steps": the interval's length,
        "before": the interval's loads under the old table, "after": under the new one}``, each a
        :func:`table_summary` (``copies`` / ``max_over_mean``)."""
        for layer in self.layers:
            c = torch.as_tensor(counts_by_layer[layer.layer_number], dtype=torch.float64)
            self.loads[layer.layer_number] = self.loads.get(layer.layer_number, 0) + c
        self.steps += 1
        if self.steps % self.interval:
            return []
        out = []
        for layer in self.layers:
            load, geo = self.loads.pop(layer.layer_number).tolist(), layer.replica_geometry()
            before = table_summary(load, layer.replica_table, **geo)
            layer.set_replica_table(plan_replicas(load, **geo))
            after = table_summary(load, layer.replica_table, **geo)
            out.append({"layer": layer.layer_number, "steps": self.interval, "before": before, "after": after})
        return out

    def summary(self, counts_by_layer: Dict[int, Sequence[float]]) -> List[Dict]:
        """The tables in use, one :func:`table_summary` per layer (with ``"layer"``) for one step's counts."""
        return [
            {
                "layer": layer.layer_number,
                **table_summary(counts_by_layer[layer.layer_number], layer.replica_table, **layer.replica_geometry()),
            }
            for layer in self.layers
        ]
