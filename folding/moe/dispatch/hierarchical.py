"""The hierarchical (node-aware) token dispatcher: a token crosses the node boundary once per node.

The EP group spans ``Nd`` nodes (``parallel.nvlink_domain`` ranks each) with ``g`` of its ranks on
every node. Two groups split it, built once with the layout's groups (``ProcessGroups.ep_rail``,
``ProcessGroups.ep_node``): the *rail* group, the EP ranks at this rank's position on every node, and
the *node* group, the EP ranks on this rank's node. Dispatch, on every rank:

1. count, per token, its experts, its distinct destination ranks and its distinct destination nodes
   (:func:`~folding.moe.dispatch.hier_plan.dedup_counts`); gather the counts over ETP, then over the EP
   ranks (on their metadata communicators, ``ProcessGroups.etp_meta`` and ``ep_meta``, when given: see
   ``counts_group``);
2. read the gathered counts on the host (the one device-to-host read of the layer), which gives
   every split of both stages (:func:`~folding.moe.dispatch.hier_plan.plan_hierarchical`);
3. stage A over the rail group: one row per token and distinct destination node, carrying that
   node's probabilities and routing map (the row for this rank's own node stays here); stage B over
   the node group: the forwarding rank sends one row per received row and distinct destination rank;
   then the ETP all-gather and one row per (row, local expert), expert-major
   (:mod:`folding.moe.dispatch.hier_exchange`).

Combine is the exact transpose with fp32 partial sums in a fixed order; the backward of dispatch is
the combine and the backward of combine the dispatch, with the saved splits (no count exchange, no
host read). Dropping is the router's (the map is capacity-limited before it gets here), so the same
tokens drop as with ``alltoall``; the de-duplicated row counts sum to less than ``T·k``, which is not
a drop. Pad-to-capacity is refused (the de-duplicated counts are not static). When the EP group lies
inside one node, :func:`folding.moe.dispatch.build.build_dispatcher` builds the ``alltoall`` dispatcher
instead: with one node the two are the same exchange.

Shape suffixes (docs/shapes.md): ``T`` tokens, ``H`` hidden, ``E`` experts, ``L`` local experts,
``N`` expert rows, ``Nd`` nodes.

Usage::

    d = HierarchicalDispatcher(num_experts=32, topk=8, ep_group=ps.groups.ep, etp_group=ps.groups.etp,
                               node_group=ps.groups.ep_node, rail_group=ps.groups.ep_rail)
    tokens_NH, record, probs_N = d.dispatch(hidden_SBH, routing_map_TE, probs_TE)
    y_SBH = d.combine(experts(tokens_NH, record, probs_N), record)
"""

from __future__ import annotations

from typing import Optional

import torch

from ...overlap.exchange import COUNTS, Exchange
from ...parallel.collectives import all_gather_nograd, gather_counts_start
from . import host_sync
from .base import DispatchCall, DispatchRecord, TokenDispatcher, _group_ranks
from .hier_exchange import HierRoute, hier_combine, hier_dispatch
from .hier_plan import dedup_counts, dedup_rows, plan_hierarchical
from .permute import check_dropless
from .wire import payload_bytes_per_row


def refuse_padding(pad_to_capacity: bool) -> None:
    """Raise if ``pad_to_capacity``: the de-duplicated row counts are not static (the one wording of this
    rule, for this dispatcher and for :func:`~folding.moe.dispatch.build.build_dispatcher`'s one-node case)."""
    if pad_to_capacity:
        raise ValueError(
            "moe.dispatcher=hierarchical does not pad to capacity (its de-duplicated row counts "
            "are not static); set moe.pad_to_capacity=false or moe.dispatcher=alltoall"
        )


class HierarchicalDispatcher(TokenDispatcher):
    """Hierarchical dispatcher (see the module docstring); arguments as :class:`TokenDispatcher`, plus:

    Args:
        node_group: the EP group's ranks on this rank's node, in EP order.
        rail_group: the EP group's ranks at this rank's position on every node, in node order.
        nvlink_domain: optional check: ranks per node (global rank ``r`` on node ``r // G``); the two
            groups must agree with it.
        counts_group: the group the counts are all-gathered over: the EP ranks on a communicator of
            their own (``ProcessGroups.ep_meta``: on NCCL, counts on the EP communicator complete only
            after everything issued before them there, such as the replicas' weight fetch); ``None``:
            the EP group.
        etp_counts_group: the group of the counts' gather over ETP, the ETP ranks on a communicator of
            their own (``ProcessGroups.etp_meta``, out of the way of the ETP payloads); ``None``: the
            ETP group.
    """

    def __init__(
        self,
        *,
        node_group,
        rail_group,
        nvlink_domain: Optional[int] = None,
        counts_group=None,
        etp_counts_group=None,
        **kwargs,
    ):
        super().__init__(**kwargs)  # refuses pad_to_capacity (:meth:`_check_capacity`)
        self.counts_group = self.ep_group if counts_group is None else counts_group
        self.etp_counts_group = self.etp_group if etp_counts_group is None else etp_counts_group
        ep = _group_ranks(self.ep_group, "ep_group")
        node = _group_ranks(node_group, "node_group")
        rail = _group_ranks(rail_group, "rail_group")
        g, nd = len(node), len(rail)
        a, i = divmod(self.ep_rank, g)
        if g * nd != len(ep) or node != ep[a * g : (a + 1) * g] or rail != ep[i::g]:
            raise ValueError(
                f"node_group {node} and rail_group {rail} do not split the EP group {ep} node-major "
                "(node group: the EP ranks of this node; rail group: those at this rank's position on "
                "every node); pass ParallelState.groups.ep_node and ParallelState.groups.ep_rail"
            )
        if nvlink_domain is not None and (
            len({r // nvlink_domain for r in node}) != 1 or len({r // nvlink_domain for r in rail}) != nd
        ):
            raise ValueError(
                f"node_group {node} / rail_group {rail} do not match parallel.nvlink_domain={nvlink_domain} "
                "(each node group on one node, each rail on distinct nodes)"
            )
        self.node_group, self.rail_group = node_group, rail_group
        self.ranks_per_node, self.num_nodes = g, nd

    @property
    def counts_hand_over(self) -> bool:
        """True: every dispatch gathers its de-duplicated counts over EP and hands over at their read."""
        return True

    def _check_capacity(self) -> None:
        """The base's capacity checks, and no padding to capacity (see :func:`refuse_padding`)."""
        super()._check_capacity()
        refuse_padding(self.pad_to_capacity)

    # ------------------------------------------------------------------------------- dispatch
    def _preprocess(self, hidden, routing_map, probs):
        """Validate, count (de-duplicated per rank and node), start the count gathers:
        ``(tokens_TH, probs_TE, call)``; the tokens move in :meth:`_exchange`."""
        H = self._validate(hidden, routing_map, probs)
        tokens_TH = hidden.reshape(-1, H)
        record = DispatchRecord(
            hidden_shape=tuple(hidden.shape), hidden_size=H, dtype=hidden.dtype, num_tokens=tokens_TH.shape[0]
        )
        call = DispatchCall(record=record, routing_map_TE=routing_map)
        counts = dedup_counts(routing_map, num_nodes=self.num_nodes, ranks_per_node=self.ranks_per_node)
        gathered = all_gather_nograd(counts, self.etp_counts_group, stack=True)
        call.counts_dev, work = gather_counts_start(gathered.unsqueeze(0), self.counts_group)
        # an overlap point: the other lane runs while the counts travel (read_counts runs the deferred
        # work first); an instrument's link model keeps its place in the counts group's order (NCCL's)
        call.counts_work = Exchange([work], what="ep counts", carries=COUNTS, group=self.counts_group)
        return tokens_TH, probs, call

    def _exchange(self, rows, probs, call):
        """Read the counts (the layer's one host read), plan both stages, run the two-stage
        exchange: ``(rows_NH, probs_N)`` expert-major."""
        # the shared expert first, then the gather's wait (under a link model, after everything issued
        # before it on its group: NCCL's order), then a pinned non-blocking copy and its event
        counts = host_sync.read_counts(call.counts_dev, work=call.counts_work, reason="hierarchical splits")
        call.counts_work = None
        E, T = self.num_experts, rows.shape[0]
        if self.dropless:
            check_dropless([[c[:E] for c in row] for row in counts], T, self.topk)
        plan = plan_hierarchical(
            counts,
            num_nodes=self.num_nodes,
            ranks_per_node=self.ranks_per_node,
            etp_size=self.etp_size,
            ep_rank=self.ep_rank,
            etp_rank=self.etp_rank,
            num_local_experts=self.num_local_experts,
        )
        token_Ra, node_Ra = dedup_rows(call.routing_map_TE.view(T, self.num_nodes, -1), sum(plan.rail_send))
        route = HierRoute(
            plan=plan,
            rail_group=self.rail_group,
            node_group=self.node_group,
            etp_group=self.etp_group,
            num_tokens=T,
            hidden_size=call.record.hidden_size,
            dtype=call.record.dtype,
            ranks_per_node=self.ranks_per_node,
            num_local_experts=self.num_local_experts,
            token_Ra=token_Ra,
            node_Ra=node_Ra,
        )
        rows_NH, probs_N, route = hier_dispatch(
            rows, probs, call.routing_map_TE, route, self.dispatch_wire, self.grad_wire
        )
        call.learn(plan=route, token_idx=route.row_N)
        return rows_NH, probs_N

    def _postprocess(self, rows, probs, call):
        """The record of the call: ``(tokens_NH, record, probs_N)`` (the rows are expert-major)."""
        route = call.record.plan
        L, lo = self.num_local_experts, self.local_expert_offset
        call.learn(
            tokens_per_expert=call.counts_dev[:, :, lo : lo + L].sum((0, 1)).to(torch.long),
            tokens_per_expert_host=tuple(route.plan.tokens_per_expert),
            stats=self._stats(route),
        )
        return rows, call.record, probs

    # -------------------------------------------------------------------------------- combine
    def _combine_pre(self, out, record: DispatchRecord):
        """Nothing local before the combine's exchanges (they start with the fp32 per-row sum)."""
        return out

    def _combine_exchange(self, out, record: DispatchRecord):
        """Sum local experts per node row, ETP reduce-scatter, node stage back, rail stage back."""
        return hier_combine(out, record.plan, self.combine_wire, self.grad_wire)

    def _combine_post(self, out, record: DispatchRecord):
        """Restore the input's shape (the exchange already summed each token's rows)."""
        return out.reshape(record.hidden_shape)

    # ---------------------------------------------------------------------------------- stats
    def _stats(self, route: HierRoute) -> dict:
        p, H, dt = route.plan, route.hidden_size, route.dtype
        disp = payload_bytes_per_row(self.dispatch_wire, H, dt)
        comb = payload_bytes_per_row(self.combine_wire, H, dt)
        me = self.ep_rank % self.ranks_per_node
        return {
            "rows_sent": sum(p.rail_send),
            "remote_rows_sent": p.remote_rail_rows,
            "remote_rows_received": p.remote_rail_recv,
            # hidden payload (scales included, metadata excluded) crossing the node boundary
            "inter_node_dispatch_bytes": p.remote_rail_rows * disp,
            "inter_node_combine_bytes": p.remote_rail_recv * comb,
            # forwarded inside the node (to other ranks than this one)
            "intra_node_dispatch_bytes": (sum(p.node_send) - p.node_send[me]) * disp,
            "intra_node_combine_bytes": (sum(p.node_recv) - p.node_recv[me]) * comb,
            "tokens_per_expert": list(p.tokens_per_expert),
        }
