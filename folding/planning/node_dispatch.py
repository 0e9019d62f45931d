"""Rows a token sends per MoE exchange under each dispatcher, for the cost model (pure arithmetic).

The ``alltoall`` dispatcher sends every routed copy on its own: of a token's ``k`` copies, those whose
expert lives on another node cross the NIC (``k·(n-1)/n`` for an expert-parallel group spanning ``n``
nodes, routing uniform). The ``hierarchical`` dispatcher sends one row per *distinct* destination node
over the NIC (stage A, to the rank with the source's position on that node), then the forwarding rank
sends one row per distinct destination rank of its node over NVLink (stage B); combine is the transpose
(partials summed per node before they cross back), so it moves the same rows.

Uniform routing: a token's ``k`` experts are drawn without replacement among the ``E`` experts, which sit
in contiguous blocks of ``E/EP`` per EP rank, ``E/n`` per node. A *unit* (a node, or one rank) holding
``u`` experts is missed with the hypergeometric probability ``C(E-u, k) / C(E, k)``; by linearity the
expected number of distinct units hit is the sum of the units' hit probabilities.

Node-limited routing (``moe.num_groups`` = G contiguous groups, ``moe.group_topk`` = M of them per token,
Megatron-Core's and DeepSeek-V3's): the token's M groups are drawn uniformly among the G, its ``k`` experts
uniformly among those groups' ``M·E/G`` experts. A unit holding whole groups (``g`` of them) is hit with
probability ``Σ_j P(j of its g groups chosen) · (1 - C((M-j)·E/G, k) / C(M·E/G, k))``; a unit inside one
group with probability ``M/G · (1 - C(M·E/G - u, k) / C(M·E/G, k))``. Units that neither hold whole groups
nor lie inside one are planned as if routing were not limited (an upper bound on the rows).

Worked example, DeepSeek-V3 (top-8 of 256) on EP64 = 8 nodes × 8 GPUs: ``alltoall`` sends 8·7/8 = 7 remote
copies; ``hierarchical`` without limit sends 7·(1 - C(224, 8)/C(256, 8)) = 4.65 remote rows over the NIC
(1.5× fewer) and, limited to 4 nodes, 3.18 (2.2× fewer).

Usage::

    rows = exchange_rows(num_experts=256, topk=8, ep=64, ranks_per_node=8, dispatcher="hierarchical")
    rows.nic, rows.nvlink        # rows per token per exchange over each link class
"""

from __future__ import annotations

import dataclasses
from math import comb
from typing import Optional

DISPATCHERS = ("alltoall", "hierarchical")
"""Dispatchers the cost model knows (``moe.dispatcher``; ``allgather`` is planned as ``alltoall``)."""


@dataclasses.dataclass(frozen=True)
class ExchangeRows:
    """Expected rows one token sends in one exchange (dispatch; combine sends the same back)."""

    nic: float
    """Rows over the inter-node link (NIC)."""
    nvlink: float
    """Rows over the intra-node link (NVLink), forwarding hop included."""


def hit_probability(
    *, num_experts: int, topk: int, unit: int, num_groups: Optional[int] = None, group_topk: Optional[int] = None
) -> float:
    """Probability that a token routes at least one of its ``topk`` copies to a unit (a node or a rank)
    holding ``unit`` contiguous experts, under uniform routing (node-limited with ``num_groups`` /
    ``group_topk``; see the module docstring)."""
    E, k = num_experts, topk
    if not num_groups or not group_topk or group_topk >= num_groups:
        return 1.0 - comb(E - unit, k) / comb(E, k)
    G, M = num_groups, group_topk
    per_group = E // G
    pool = M * per_group  # the experts of a token's chosen groups
    if unit % per_group == 0:  # the unit holds g whole groups
        g = unit // per_group
        return sum(
            comb(g, j) * comb(G - g, M - j) / comb(G, M) * (1.0 - comb((M - j) * per_group, k) / comb(pool, k))
            for j in range(1, min(g, M) + 1)
        )
    if per_group % unit == 0:  # the unit lies inside one group
        return M / G * (1.0 - comb(pool - unit, k) / comb(pool, k))
    return 1.0 - comb(E - unit, k) / comb(E, k)


def exchange_rows(
    *,
    num_experts: int,
    topk: int,
    ep: int,
    ranks_per_node: int,
    dispatcher: str,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
) -> ExchangeRows:
    """Expected :class:`ExchangeRows` of one token for an EP group of ``ep`` ranks, ``ranks_per_node`` of
    them on each node (``ep`` when the group stays in one node), under ``dispatcher``.

    ``alltoall``: the remote copies, ``k·(EP-1)/EP`` in all, the share on other nodes over the NIC.
    ``hierarchical``: ``(n-1)·P(node hit)`` rows over the NIC (the own node's row stays local) and
    ``n·(ranks_per_node-1)·P(rank hit)`` over NVLink (every rank of a hit node other than the forwarder
    gets a row when one of its experts is routed to; the forwarder is the source on its own node).
    On one node both are the same exchange."""
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"--dispatcher {dispatcher!r}: choose one of {', '.join(DISPATCHERS)}")
    per_node = min(ranks_per_node, ep)
    nodes = ep // per_node
    k = topk
    if dispatcher == "alltoall" or nodes == 1:
        return ExchangeRows(nic=k * (ep - per_node) / ep, nvlink=k * (per_node - 1) / ep)
    lim = dict(num_groups=num_groups, group_topk=group_topk)
    p_node = hit_probability(num_experts=num_experts, topk=k, unit=num_experts // nodes, **lim)
    p_rank = hit_probability(num_experts=num_experts, topk=k, unit=num_experts // ep, **lim)
    return ExchangeRows(nic=(nodes - 1) * p_node, nvlink=nodes * (per_node - 1) * p_rank)
