"""The hierarchical dispatcher's planning as pure functions: de-duplicated counts, rows and splits.

Nothing here touches a process group; :mod:`folding.moe.dispatch.hierarchical` composes these with
the two exchanges (:mod:`folding.moe.dispatch.hier_exchange`), and each is unit-tested with small hand-worked
cases.

The EP group spans ``Nd`` nodes with ``g`` EP ranks on each, node-major: EP index ``d = n·g + i``
(node ``n``, position ``i``), so node ``n`` holds the ``g·L`` experts ``[n·g·L, (n+1)·g·L)``. A token
goes to node ``n`` once if any of its experts lives there (one *rail* row, stage A), and from the
forwarding rank to each rank ``j`` of that node once if any of its experts lives on ``j`` (one
*node* row, stage B).

Shape suffixes (docs/shapes.md): ``T`` tokens, ``E`` experts, ``R`` ranks, ``Nd`` nodes of the EP
group, ``Ln`` experts of one node (``g·L``), ``L`` local experts, ``Ra`` rail rows, ``Rb`` node rows.

Usage::

    counts = dedup_counts(routing_map_TE, num_nodes=2, ranks_per_node=4)    # [E + EP + Nd]
    plan = plan_hierarchical(gathered, num_nodes=2, ranks_per_node=4, etp_size=1, ep_rank=5,
                             etp_rank=0, num_local_experts=2)
    token_Ra, node_Ra = dedup_rows(routing_map_TE.view(T, 2, -1), sum(plan.rail_send))
"""

from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

import torch


def dedup_counts(routing_map_TE: torch.Tensor, *, num_nodes: int, ranks_per_node: int) -> torch.Tensor:
    """This rank's counts for the plan, one ``int64`` vector ``[E + EP + Nd]`` on the map's device:
    rows per expert (the (token, expert) pairs), then tokens per EP rank (a token counted once per
    rank however many of its experts live there), then tokens per node (once per node).

    Example: 2 tokens, 4 experts on EP2 (2 nodes of 1 rank), token 0 → experts 0, 1, token 1 → 1, 3:
    per expert ``[1, 2, 0, 1]``, per rank ``[2, 1]``, per node ``[2, 1]``."""
    T, E = routing_map_TE.shape
    ep = num_nodes * ranks_per_node
    per_rank_TR = routing_map_TE.view(T, ep, E // ep).any(-1)
    per_node_TNd = per_rank_TR.view(T, num_nodes, ranks_per_node).any(-1)
    return torch.cat([routing_map_TE.sum(0), per_rank_TR.sum(0), per_node_TNd.sum(0)]).to(torch.long)


def dedup_rows(map_TNdLn: torch.Tensor, num_rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """One row per (token, group) pair whose group holds any True of ``map_TNdLn`` ``[T, G, X]``:
    ``(token_idx, group_idx)``, group-major then token order (the send layout of an all-to-all whose
    destinations are the groups). ``num_rows`` is their number, known on the host from the plan (no
    device-to-host read here).

    Example: ``map[t, n]`` any = ``[[1, 1], [0, 1], [1, 0]]`` (3 tokens, 2 groups): rows for group 0
    are tokens 0, 2, for group 1 tokens 0, 1: ``token_idx = [0, 2, 0, 1]``, ``group_idx = [0, 0, 1, 1]``."""
    T = map_TNdLn.shape[0]
    any_TNd = map_TNdLn.any(-1)
    pos = torch.nonzero_static(any_TNd.t().reshape(-1), size=num_rows).squeeze(1)
    return pos % T, pos // T


@dataclasses.dataclass(frozen=True)
class HierPlan:
    """Host-side split sizes of one hierarchical dispatch (see :func:`plan_hierarchical`)."""

    rail_send: List[int]
    """Stage A: rows this rank sends to each node (rail order), its own node's included (that chunk
    stays on this rank)."""
    rail_recv: List[int]
    """Stage A: rows this rank receives from the rail rank of each node (its own rows included)."""
    node_send: List[int]
    """Stage B: rows this rank forwards to each rank of its node (node order, itself included)."""
    node_recv: List[int]
    """Stage B: rows this rank receives from each forwarding rank of its node."""
    etp_sizes: List[int]
    """Stage-B rows each ETP rank of this rank's ETP group holds (the ETP all-gather's sizes)."""
    tokens_per_expert: List[int]
    """Rows each local expert receives (over every source and ETP rank)."""
    own_node: int
    """This rank's node (its index in the rail group)."""

    @property
    def remote_rail_rows(self) -> int:
        """Stage-A rows this rank sends across the node boundary (one per token and remote node)."""
        return sum(self.rail_send) - self.rail_send[self.own_node]

    @property
    def remote_rail_recv(self) -> int:
        """Stage-A rows this rank receives across the node boundary."""
        return sum(self.rail_recv) - self.rail_recv[self.own_node]


def plan_hierarchical(
    counts: Sequence[Sequence[Sequence[int]]],
    *,
    num_nodes: int,
    ranks_per_node: int,
    etp_size: int,
    ep_rank: int,
    etp_rank: int,
    num_local_experts: int,
) -> HierPlan:
    """Split sizes of both stages from every rank's :func:`dedup_counts`.

    Args:
        counts: ``counts[s][j]`` = the count vector of the rank with EP index ``s`` and ETP index ``j``
            (nested lists ``[EP][ETP][E + EP + Nd]``; one gathered matrix gives every split).
        num_nodes, ranks_per_node: ``Nd`` and ``g`` (``EP = Nd·g``, EP index ``n·g + i``).
        etp_size, ep_rank, etp_rank: this rank's coordinates in the expert view.
        num_local_experts: ``L``.

    Stage-A rows on the forwarding rank ``(a, i)`` come from the rail ranks ``(n, i)`` of every node;
    it forwards each to the ranks of node ``a`` that need it, so its stage-B sends to rank ``(a, j)``
    are ``Σ_n`` (tokens of ``(n, i)`` for ``(a, j)``).
    """
    g, L, ep = ranks_per_node, num_local_experts, num_nodes * ranks_per_node
    if len(counts) != ep or any(len(c) != etp_size for c in counts):
        raise ValueError(f"plan_hierarchical: counts must be [EP={ep}][ETP={etp_size}][...] nested lists")
    E = ep * L
    if len(counts[0][0]) != E + ep + num_nodes:
        raise ValueError(f"plan_hierarchical: count vectors must have E + EP + Nd = {E + ep + num_nodes} entries")
    a, i = divmod(ep_rank, g)

    def per_rank(s, j, d):
        return counts[s][j][E + d]

    def per_node(s, j, n):
        return counts[s][j][E + ep + n]

    jj = etp_rank
    rail_send = [per_node(ep_rank, jj, n) for n in range(num_nodes)]
    rail_recv = [per_node(n * g + i, jj, a) for n in range(num_nodes)]
    node_send = [sum(per_rank(n * g + i, jj, a * g + j) for n in range(num_nodes)) for j in range(g)]
    node_recv = [sum(per_rank(n * g + i2, jj, ep_rank) for n in range(num_nodes)) for i2 in range(g)]
    etp_sizes = [sum(per_rank(s, j, ep_rank) for s in range(ep)) for j in range(etp_size)]
    local = range(ep_rank * L, (ep_rank + 1) * L)
    tokens_per_expert = [sum(counts[s][j][e] for s in range(ep) for j in range(etp_size)) for e in local]
    return HierPlan(
        rail_send=rail_send,
        rail_recv=rail_recv,
        node_send=node_send,
        node_recv=node_recv,
        etp_sizes=etp_sizes,
        tokens_per_expert=tokens_per_expert,
        own_node=a,
    )
