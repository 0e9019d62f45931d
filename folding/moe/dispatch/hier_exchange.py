"""The hierarchical dispatcher's two-stage exchanges (autograd functions).

Dispatch, on a rank of node ``a`` at position ``i`` (see :mod:`folding.moe.dispatch.hier_plan`):

- stage A over the *rail* group (the EP ranks at position ``i`` of every node; it crosses nodes):
  one row per token and distinct destination node, carrying the hidden state (in the dispatch wire
  format) and that node's probabilities and routing map (``[g·L]`` each); the own node's row stays
  on this rank (its chunk of the all-to-all is a local copy);
- stage B over the *node* group (the EP ranks of node ``a``): the forwarding rank sends one row per
  received row and distinct destination rank, the encoded bytes as they arrived (no second
  rounding) and that rank's ``[L]`` probabilities and map;
- the ETP all-gather of those rows (inside the node when ETP is), then one row per (row, local
  expert), expert-major.

Combine is the exact transpose, summing in fp32 in a fixed order: each rank sums its local experts'
outputs per node row (one expert at a time), the ETP ranks' partials are reduce-scattered, each
forwarding rank sums its node's partials per rail row (one destination rank at a time) and sends one
partial back, and the source sums at most one partial per node (one node at a time). Every such loop
adds rows with distinct indices, so the sum is deterministic on any device. The backward of dispatch
is this combine (with the probabilities' gradients carried back beside it) and the backward of
combine is the dispatch, both with the saved indices and splits: no count exchange, no host read.

Shape suffixes (docs/shapes.md): ``T`` tokens, ``H`` hidden, ``E`` experts, ``L`` local experts,
``Nd`` nodes, ``Ln`` experts of one node, ``Ra`` rail rows, ``Rb`` node rows, ``N`` expert rows.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from ...overlap.runtime import current_runtime, entered
from .hier_plan import HierPlan, dedup_rows
from .wire import _a2a_all, _gather_all, _reduce_scatter_all, decode, encode


@dataclasses.dataclass(frozen=True)
class HierRoute:
    """One call's plan and device indices. The source side (``token_Ra``, ``node_Ra``) is known
    before the exchange; the dispatch's forward returns a copy with the rest filled in, which the
    combine and both backwards read."""

    plan: HierPlan
    """Host split sizes of both stages."""
    rail_group: object
    """Stage A's group (the EP ranks at this rank's position on every node)."""
    node_group: object
    """Stage B's group (the EP ranks of this rank's node)."""
    etp_group: object
    """The ETP group."""
    num_tokens: int
    """T."""
    hidden_size: int
    """H."""
    dtype: torch.dtype
    """Activation dtype."""
    ranks_per_node: int
    """g."""
    num_local_experts: int
    """L."""
    token_Ra: Optional[torch.Tensor] = None
    """Source token of each stage-A row this rank sends (node-major)."""
    node_Ra: Optional[torch.Tensor] = None
    """Destination node of each stage-A row this rank sends."""
    row_Rb: Optional[torch.Tensor] = None
    """Received stage-A row of each stage-B row this rank forwards (destination-major)."""
    dest_Rb: Optional[torch.Tensor] = None
    """Destination rank (position in the node) of each stage-B row this rank forwards."""
    row_N: Optional[torch.Tensor] = None
    """ETP-gathered stage-B row of each expert row (expert-major)."""
    expert_N: Optional[torch.Tensor] = None
    """Local expert of each expert row."""
    num_gathered: int = 0
    """Stage-B rows after the ETP all-gather."""


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of partial sums: fp32, or the rows' own when wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _sum_chunks(x: torch.Tensor, idx: torch.Tensor, sizes: List[int], num_rows: int) -> torch.Tensor:
    """``out[idx[n]] += x[n]`` in fp32 (fp64 rows in fp64), one chunk of ``sizes`` at a time (indices
    distinct inside a chunk, so every element is summed in chunk order: deterministic on any device)."""
    acc = _acc(x.dtype)
    out = x.new_zeros((num_rows,) + tuple(x.shape[1:]), dtype=acc)
    for xs, ids in zip(torch.split(x, sizes), torch.split(idx, sizes)):
        out.index_add_(0, ids, xs.to(acc))
    return out


def _to_experts(x_TH, route: HierRoute, wire: str, meta=None, what: str = "dispatch"):
    """Rows ``[N, H]`` at the experts for tokens ``x_TH`` along the route (stage A, stage B, ETP
    all-gather, expand expert-major). ``meta``: ``(map_TE, probs_TE)`` on the first pass, which
    computes the stage-B and expansion indices: then returns ``(rows_NH, probs_N, route)`` with the
    route's indices filled in, else ``rows_NH``."""
    p, g, L = route.plan, route.ranks_per_node, route.num_local_experts
    parts = list(encode(x_TH.index_select(0, route.token_Ra), wire))
    nb = len(parts)
    if meta is not None:
        map_TE, probs_TE = meta
        T, nd = map_TE.shape[0], len(p.rail_send)
        map_TNdLn, probs_TNdLn = map_TE.view(T, nd, -1), probs_TE.view(T, nd, -1)
        parts += [
            probs_TNdLn[route.token_Ra, route.node_Ra].detach(),
            map_TNdLn[route.token_Ra, route.node_Ra].view(torch.uint8),
        ]
    parts = _a2a_all(parts, route.rail_group, p.rail_recv, p.rail_send, what=f"ep rail {what}")
    if meta is not None:
        ra = sum(p.rail_recv)
        map_RaRL = parts[nb + 1].view(torch.bool).view(ra, g, L)
        row_Rb, dest_Rb = dedup_rows(map_RaRL, sum(p.node_send))
        route = dataclasses.replace(route, row_Rb=row_Rb, dest_Rb=dest_Rb)
        probs_RaRL = parts[nb].view(ra, g, L)
        meta_b = [probs_RaRL[row_Rb, dest_Rb], map_RaRL[row_Rb, dest_Rb].view(torch.uint8)]
    else:
        meta_b = []
    parts = [q.index_select(0, route.row_Rb) for q in parts[:nb]] + meta_b
    parts = _a2a_all(parts, route.node_group, p.node_recv, p.node_send, what=f"ep node {what}")
    parts = _gather_all(parts, route.etp_group, p.etp_sizes)
    rows = decode(parts[:nb], wire, route.hidden_size, route.dtype)
    if meta is None:
        return rows.index_select(0, route.row_N)
    R = rows.shape[0]
    map_RL = parts[nb + 1].view(torch.bool)
    pos = torch.nonzero_static(map_RL.t().reshape(-1), size=sum(p.tokens_per_expert)).squeeze(1)
    route = dataclasses.replace(route, row_N=pos % R, expert_N=pos // R, num_gathered=R)
    return rows.index_select(0, route.row_N), parts[nb][route.row_N, route.expert_N], route


def _from_experts(out_NH, route: HierRoute, wire: str, gprobs_N=None, what: str = "combine"):
    """The transpose of :func:`_to_experts`: the fp32 sum of each token's expert rows ``[T, H]`` (in
    the activation dtype), and with ``gprobs_N`` the probabilities' gradients ``[T, E]`` beside it."""
    p, g, L, H = route.plan, route.ranks_per_node, route.num_local_experts, route.hidden_size
    acc = _sum_chunks(out_NH, route.row_N, p.tokens_per_expert, route.num_gathered)
    extra = []
    if gprobs_N is not None:
        gp_RL = gprobs_N.new_zeros((route.num_gathered, L), dtype=_acc(gprobs_N.dtype))
        gp_RL[route.row_N, route.expert_N] = gprobs_N.to(gp_RL.dtype)
        extra = [gp_RL]
    red = _reduce_scatter_all([acc] + extra, route.etp_group, p.etp_sizes)
    parts = list(encode(red[0].to(route.dtype), wire))
    nb = len(parts)
    parts = _a2a_all(parts + red[1:], route.node_group, p.node_send, p.node_recv, what=f"ep node {what}")
    ra = sum(p.rail_recv)
    acc = _sum_chunks(decode(parts[:nb], wire, H, route.dtype), route.row_Rb, p.node_send, ra)
    if gprobs_N is not None:
        gp_RaRL = acc.new_zeros((ra, g, L), dtype=parts[nb].dtype)
        gp_RaRL[route.row_Rb, route.dest_Rb] = parts[nb]
        extra = [gp_RaRL.view(ra, g * L)]
    parts = list(encode(acc.to(route.dtype), wire))
    parts = _a2a_all(parts + extra, route.rail_group, p.rail_send, p.rail_recv, what=f"ep rail {what}")
    T = route.num_tokens
    y = _sum_chunks(decode(parts[:nb], wire, H, route.dtype), route.token_Ra, p.rail_send, T).to(route.dtype)
    if gprobs_N is None:
        return y, None
    nd = len(p.rail_send)
    gp_TNdLn = y.new_zeros((T, nd, g * L), dtype=parts[nb].dtype)
    gp_TNdLn[route.token_Ra, route.node_Ra] = parts[nb]
    return y, gp_TNdLn.view(T, nd * g * L)


class _HierDispatch(torch.autograd.Function):
    """Forward: stage A (rail all-to-all), stage B (node all-to-all), ETP all-gather, expand.
    Backward: the combine's path with the probabilities' gradients beside it (``grad_wire``)."""

    @staticmethod
    def forward(ctx, x_TH, probs_TE, map_TE, route: HierRoute, wire: str, grad_wire: str):
        rows, probs_N, ctx.route = _to_experts(x_TH, route, wire, meta=(map_TE, probs_TE))
        ctx.grad_wire, ctx.probs_dtype, ctx.overlap = grad_wire, probs_TE.dtype, current_runtime()
        return rows, probs_N, ctx.route

    @staticmethod
    def backward(ctx, g_NH, gp_N, _route):
        with entered(ctx.overlap):  # the forward's overlap runtime (on CUDA this runs on another thread)
            gx, gp = _from_experts(g_NH, ctx.route, ctx.grad_wire, gprobs_N=gp_N, what="dispatch backward")
        return gx, gp.to(ctx.probs_dtype), None, None, None, None


class _HierCombine(torch.autograd.Function):
    """Forward: sum over local experts, ETP reduce-scatter, node stage back (forwarder's fp32 sum),
    rail stage back (source's fp32 sum). Backward: the dispatch's path (``grad_wire``)."""

    @staticmethod
    def forward(ctx, out_NH, route: HierRoute, wire: str, grad_wire: str):
        ctx.route, ctx.grad_wire, ctx.overlap = route, grad_wire, current_runtime()
        return _from_experts(out_NH, route, wire)[0]

    @staticmethod
    def backward(ctx, g_TH):
        with entered(ctx.overlap):  # the forward's overlap runtime (on CUDA this runs on another thread)
            rows = _to_experts(g_TH.contiguous(), ctx.route, ctx.grad_wire, what="combine backward")
        return rows, None, None, None


def hier_dispatch(x_TH, probs_TE, map_TE, route: HierRoute, wire: str, grad_wire: str):
    """Move tokens to their experts along ``route`` (whose ``token_Ra``/``node_Ra`` are set):
    ``(rows_NH, probs_N, route)`` expert-major, ``route`` with every index filled in (for the
    combine). Forward: rail all-to-all, node all-to-all, ETP all-gather (``wire``). Backward: ETP
    reduce-scatter, node and rail all-to-alls back with fp32 partial sums (``grad_wire``)."""
    return _HierDispatch.apply(x_TH, probs_TE, map_TE, route, wire, grad_wire)


def hier_combine(out_NH, route: HierRoute, wire: str, grad_wire: str):
    """Bring expert outputs back to their tokens along ``route``: ``[T, H]``, each token's rows summed
    in fp32 (per node on the forwarding rank, then per token on the source). Forward: ETP
    reduce-scatter, node all-to-all back, rail all-to-all back (``wire``). Backward: the dispatch's
    three exchanges (``grad_wire``)."""
    return _HierCombine.apply(out_NH, route, wire, grad_wire)
