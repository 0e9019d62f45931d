"""Token dispatchers: move the attention rank's tokens to the ranks of their experts and back.

The engine's path is :meth:`TokenDispatcher.dispatch`, which returns the rows with a
:class:`~folding.moe.dispatch.base.DispatchRecord` of that call, and
:meth:`TokenDispatcher.combine`, which takes the record back: a dispatcher holds configuration and
groups only, so several micro-batches can be in flight through one layer. Megatron-Core's six-stage
``MoETokenDispatcher`` interface is an adapter over the same stages, at the edge of the package
(:class:`folding.interop.megatron.stages.MegatronDispatcher`).

- :class:`~folding.moe.dispatch.alltoall.AllToAllDispatcher`: permute locally by expert, EP
  all-to-all, ETP all-gather, sort by local expert; the reverse with an ETP reduce-scatter.
- :class:`~folding.moe.dispatch.allgather.AllGatherDispatcher`: all-gather tokens, probabilities and
  map over ETP×EP, keep the local experts' columns; reduce-scatter on the way back.
- :class:`~folding.moe.dispatch.hierarchical.HierarchicalDispatcher`: when EP spans nodes, a token
  crosses the node boundary once per destination node (rail all-to-all) and is forwarded inside the
  node (node all-to-all); the combine sums each node's partials in fp32 before they cross back.

Router probabilities travel with the tokens; the experts apply them (after the activation) and the
combine is an unweighted sum. ``record.tokens_per_expert`` is an ``int64`` tensor on the tokens'
device (derived there from the gathered counts, so a grouped GEMM builds its offsets without a host
copy); the same counts as Python ints, known on the host from the split sizes, are in
``record.tokens_per_expert_host`` for backends that need host sizes (TransformerEngine's
``m_splits``), so neither direction crosses again. Chunks are reordered by split/cat with host sizes: no index
tensor is built from host data on the hot path.

Under folding, the input tokens are this *attention* rank's local tokens, distinct on every rank,
and every rank of the ETP×EP domain must hold the same number ``T`` of them (equal micro-batch
shapes). Dropless mode (``capacity_factor=None``) needs exactly ``topk`` experts per token in the map;
dropping modes need the map already capacity-limited by the router (decided from local tokens).

Usage::

    d = build_dispatcher("alltoall", num_experts=8, topk=2, ep_group=ps.groups.ep, etp_group=ps.groups.etp)
    d = dispatcher_for(moe_cfg, ps.groups)          # the MoE layer's: every setting from its MoEConfig
    tokens_NH, record, probs_N = d.dispatch(hidden_SBH, routing_map_TE, probs_TE)
    out_SBH = d.combine(experts(tokens_NH, record, probs_N), record)
"""

from __future__ import annotations

from typing import Optional

from folding.parallel.collectives import group_size
from folding.parallel.groups import ProcessGroups, shared_node_split_groups

from ..config import DISPATCHERS, MoEConfig
from .allgather import AllGatherDispatcher
from .alltoall import AllToAllDispatcher
from .base import DispatchRecord, TokenDispatcher, _group_ranks
from .hierarchical import HierarchicalDispatcher, refuse_padding

__all__ = [
    "DISPATCHERS",
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "DispatchRecord",
    "HierarchicalDispatcher",
    "TokenDispatcher",
    "build_dispatcher",
    "dispatcher_for",
]


def build_dispatcher(
    kind: str, *, node_group=None, rail_group=None, nvlink_domain: Optional[int] = None, **kwargs
) -> TokenDispatcher:
    """Create the dispatcher named ``kind`` (``alltoall``, ``allgather`` or ``hierarchical``) with
    ``kwargs`` (:class:`~folding.moe.dispatch.base.TokenDispatcher`'s keywords).

    ``hierarchical`` also takes the EP group split by node: ``node_group`` and ``rail_group``
    (``ParallelState.groups.ep_node`` / ``ep_rail``, built with the layout's groups from
    ``parallel.nvlink_domain``), and ``nvlink_domain`` (ranks per node) to check them against; given
    ``nvlink_domain`` alone, the two groups are created by the first such dispatcher of the process
    and shared by every later one (:func:`folding.parallel.shared_node_split_groups`: the first call is
    collective over the world, so every rank builds its first one at the same point; a different EP
    group or ``nvlink_domain`` is refused). When the EP group lies inside one node (no rail group, or one
    of a single rank) it is the ``alltoall`` dispatcher: with one node the two are the same exchange."""
    if kind == "alltoall":
        return AllToAllDispatcher(**kwargs)
    if kind == "allgather":
        return AllGatherDispatcher(**kwargs)
    if kind == "hierarchical":
        if node_group is None and rail_group is None and nvlink_domain is not None and group_size(None) > 1:
            node_group, rail_group = shared_node_split_groups(kwargs["ep_group"], nvlink_domain)
        if rail_group is None or len(_group_ranks(rail_group, "rail_group")) == 1:
            refuse_padding(kwargs.get("pad_to_capacity", False))  # whether the domain spans nodes or not
            return AllToAllDispatcher(**kwargs)
        return HierarchicalDispatcher(
            node_group=node_group, rail_group=rail_group, nvlink_domain=nvlink_domain, **kwargs
        )
    raise ValueError(f"moe.dispatcher={kind!r} is not a dispatcher; choose one of {DISPATCHERS}")


def dispatcher_for(config: MoEConfig, groups: ProcessGroups, num_slots: int | None = None) -> TokenDispatcher:
    """The dispatcher of an MoE layer: kind, experts, capacity and wires from ``config``, the expert
    groups (``groups.ep``, ``groups.etp``, ``groups.ep_meta`` and ``groups.etp_meta`` for the token counts
    of ``alltoall`` and ``hierarchical``, and for ``hierarchical`` ``groups.ep_node`` / ``groups.ep_rail``)
    from the rank's group record.
    ``num_slots``: route over that many expert slots instead of ``config.num_experts`` (hot-expert
    replicas, :mod:`folding.moe.replicas.table`: ``EP·(L+R)``)."""
    split = {"node_group": groups.ep_node, "rail_group": groups.ep_rail} if config.dispatcher == "hierarchical" else {}
    if config.dispatcher in ("alltoall", "hierarchical"):  # the counts on the metadata communicators
        split["counts_group"], split["etp_counts_group"] = groups.ep_meta, groups.etp_meta
    return build_dispatcher(
        config.dispatcher,
        num_experts=config.num_experts if num_slots is None else num_slots,
        topk=config.topk,
        ep_group=groups.ep,
        etp_group=groups.etp,
        capacity_factor=config.capacity_factor,
        pad_to_capacity=config.pad_to_capacity,
        dispatch_wire=config.dispatch_wire,
        combine_wire=config.combine_wire,
        grad_wire=config.grad_wire,
        **split,
    )
