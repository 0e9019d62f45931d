"""Replica weights: fetched from their owners once per step, their gradients returned once per step.

A replica slot is not a parameter. Each MoE layer with replicas holds a :class:`ReplicaWeights`: this
rank's replica-slot weights and the replicas' weight gradients gathered so far.

- **Inside a step** (:func:`replica_step`, which the pipeline's ``run_microbatches`` enters around one
  optimizer step's schedule) the first forward fetches the owners' current weights (one exchange per
  layer) and every later forward of the step (every micro-batch, every recomputation) computes with
  the same tensors. The backward adds the replicas' gradients into local fp32 sums, without any
  collective, however the backward reaches them (``parallel.delay_wgrad`` delivers fc2's and fc1's
  in two separate deferred backwards). When the schedule has ended, one exchange per layer returns
  the sums to their owners, which add them into their experts' gradients (``main_grad`` when the
  optimizer keeps one, else ``.grad``), and the weights are dropped: the next step fetches what the
  optimizer made of them. The owners' parameters are marked (:func:`completes_after_backward`) so
  that the optimizer reduces their buckets after that, not from backward hooks.
- **Outside a step** (a layer run on its own, evaluation) every forward fetches, nothing is kept, and
  the backward returns the gradients through autograd as soon as both weights' have arrived, before
  the owners' ``AccumulateGrad``: the layer's backward alone gives the owners' full gradients.

The slot table changes only between steps (:class:`folding.moe.replicas.table.ReplicaSchedule`); parameters
change only between steps (optimizer, checkpoint load), and the step's end drops the weights.

Collectives (each one ``all_to_all_single`` over ``ep_group``, sizes from the slot table that every
rank holds, so no count exchange; no autograd of their own):

- fetch (:func:`fetch_replica_weights`): every owner selects, per destination EP rank, the experts that
  rank's replica slots name (slot order), joins those experts' fc1 and fc2 rows side by side and sends
  them; each rank places what it receives into its slots (empty slots are zeros).
- return (:func:`return_replica_grads`): the reverse exchange: each rank sends its replica slots'
  gradients back to their owners, which ``index_add`` them into their experts' (one row per replica).

Under ETP the weight is this ETP rank's shard, and ``ep_group`` holds the ranks with the same ETP
index, so a replica is the same shard as its owner's.

Shape suffixes (docs/shapes.md): ``L`` local experts, ``Lr`` this rank's replica slots.

Usage::

    w1_Lr, w2_Lr = fetch_replica_weights([fc1_L, fc2_L], table, ep_group=g, ep_size=4, ep_rank=r, num_replicas=2)
    with replica_step(chunks):     # fetch once, return once
        run_the_schedule()
"""

from __future__ import annotations

import contextlib
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .table import EMPTY, IndexCache

_LATE = "_folding_grad_after_backward"


def completes_after_backward(p: torch.Tensor) -> torch.Tensor:
    """Mark ``p`` as a parameter that receives part of its gradient after the step's backward (the
    replicas' gradients, returned when the schedule ends); returns ``p``."""
    setattr(p, _LATE, True)
    return p


def gets_grad_after_backward(p: torch.Tensor) -> bool:
    """Whether :func:`completes_after_backward` marked ``p`` (the optimizer then reduces its gradient
    bucket after the schedule, never from a backward hook)."""
    return bool(getattr(p, _LATE, False))


def _route_tensors(
    table: Tuple[int, ...], ep_size: int, ep_rank: int, L: int, R: int, device: torch.device, cache=None
):
    """:func:`_routes` with the two index lists as tensors on ``device``; with the layer's ``cache``
    (:class:`~folding.moe.replicas.table.IndexCache`) built once per table (no host→device copy per
    layer call), else now."""
    key = (table, ep_size, ep_rank, L, R, device)
    if cache is not None:
        return cache.get(key, lambda: _route_tensors(*key))
    send_idx, send_splits, recv_slots, recv_splits = _routes(table, ep_size, ep_rank, L, R)
    idx = torch.tensor(send_idx, dtype=torch.long, device=device)
    slots = torch.tensor(recv_slots, dtype=torch.long, device=device)
    return idx, send_splits, slots, recv_splits


def _routes(table: Sequence[int], ep_size: int, ep_rank: int, L: int, R: int):
    """``(send_idx, send_splits, recv_slots, recv_splits)``: the local experts this rank sends, per
    destination in rank order; the replica slots it fills, per owner in rank order."""
    send_idx: List[int] = []
    send_splits: List[int] = []
    for d in range(ep_size):
        mine = [e - ep_rank * L for e in table[d * R : (d + 1) * R] if e != EMPTY and e // L == ep_rank]
        send_idx += mine
        send_splits.append(len(mine))
    own = list(table[ep_rank * R : (ep_rank + 1) * R])
    recv_slots: List[int] = []
    recv_splits: List[int] = []
    for src in range(ep_size):
        slots = [j for j, e in enumerate(own) if e != EMPTY and e // L == src]
        recv_slots += slots
        recv_splits.append(len(slots))
    return send_idx, send_splits, recv_slots, recv_splits


def fetch_replica_weights(
    weights,
    table: Sequence[int],
    *,
    ep_group,
    ep_size: int,
    ep_rank: int,
    num_replicas: int,
    cache: Optional[IndexCache] = None,
):
    """This rank's replica-slot weights ``[R, ...]``, one per weight of ``weights`` (each ``[L, ...]``:
    this rank's owned experts; a single tensor gives a single result), detached, in one exchange (see
    the module docstring). Only the experts some rank replicates are selected and joined. Every rank
    of ``ep_group`` must call it with the same ``table``; an all-empty table returns zeros without
    any collective. ``cache``: the layer's :class:`~folding.moe.replicas.table.IndexCache` of the table's
    index tensors (without one they are copied from the host now)."""
    ws = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    R = num_replicas
    out = [w.new_zeros((R,) + tuple(w.shape[1:])) for w in ws]
    if all(e == EMPTY for e in table):
        return out[0] if isinstance(weights, torch.Tensor) else out
    idx, send_splits, slots, recv_splits = _route_tensors(
        tuple(table), ep_size, ep_rank, ws[0].shape[0], R, ws[0].device, cache
    )
    widths = [w[0].numel() for w in ws]
    with torch.no_grad():
        picked = [w.detach().index_select(0, idx).reshape(idx.numel(), n) for w, n in zip(ws, widths)]
        send = picked[0] if len(picked) == 1 else torch.cat(picked, dim=1)
        recv = send.new_empty((slots.numel(), sum(widths)))
        dist.all_to_all_single(recv, send.contiguous(), recv_splits, send_splits, group=ep_group)
        for o, part in zip(out, recv.split(widths, dim=1)):
            o.index_copy_(0, slots, part.reshape((-1,) + tuple(o.shape[1:])))
    return out[0] if isinstance(weights, torch.Tensor) else out


def return_replica_grads(
    grads_Lr: Sequence[torch.Tensor],
    table: Sequence[int],
    *,
    ep_group,
    ep_size: int,
    ep_rank: int,
    num_local_experts: int,
    cache: Optional[IndexCache] = None,
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """The replicas' gradients (one ``[R, ...]`` per weight) sent back to their owners in one exchange.
    Returns ``(idx, rows)``: the owned experts ``[n]`` (repeated when several ranks replicate one) and,
    per weight, the gradient rows ``[n, ...]`` to ``index_add`` into them. ``cache``: as
    :func:`fetch_replica_weights`'s (the same tensors serve both directions)."""
    R = grads_Lr[0].shape[0]
    idx, send_splits, slots, recv_splits = _route_tensors(
        tuple(table), ep_size, ep_rank, num_local_experts, R, grads_Lr[0].device, cache
    )
    widths = [g[0].numel() for g in grads_Lr]
    with torch.no_grad():
        send = torch.cat([g.index_select(0, slots).reshape(slots.numel(), n) for g, n in zip(grads_Lr, widths)], dim=1)
        recv = send.new_empty((idx.numel(), sum(widths)))
        dist.all_to_all_single(recv, send.contiguous(), send_splits, recv_splits, group=ep_group)
    rows = [part.reshape((-1,) + tuple(g.shape[1:])) for g, part in zip(grads_Lr, recv.split(widths, dim=1))]
    return idx, rows


class _StepUse(torch.autograd.Function):
    """Inside a step: forward, aliases of the step's replica weights; backward, their gradients go to
    the :class:`ReplicaWeights` sums and nowhere else (the owners get them when the step ends)."""

    @staticmethod
    def forward(ctx, w1_Lr, w2_Lr, store):
        ctx.set_materialize_grads(False)
        ctx.store = store
        return w1_Lr.view_as(w1_Lr), w2_Lr.view_as(w2_Lr)

    @staticmethod
    def backward(ctx, g1_Lr, g2_Lr):
        ctx.store._add((g1_Lr, g2_Lr))
        return None, None, None


class _ReplicaUse(torch.autograd.Function):
    """Outside a step: forward, the replica weights ``(w1_Lr, w2_Lr)`` just fetched; backward, their
    gradients are gathered until both have arrived for this use, then returned to the owners through
    this node (one exchange), before the owners' ``AccumulateGrad``."""

    @staticmethod
    def forward(ctx, w1_L, w2_L, w1_Lr, w2_Lr, store, route):
        ctx.set_materialize_grads(False)
        ctx.store, ctx.route, ctx.waiting = store, route, [True, True]
        ctx.dtypes = (w1_L.dtype, w2_L.dtype)
        return w1_Lr.view_as(w1_Lr), w2_Lr.view_as(w2_Lr)

    @staticmethod
    def backward(ctx, g1_Lr, g2_Lr):
        store = ctx.store
        store._add((g1_Lr, g2_Lr))
        for i, g in enumerate((g1_Lr, g2_Lr)):
            ctx.waiting[i] = ctx.waiting[i] and g is None
        if any(ctx.waiting):
            return None, None, None, None, None, None
        idx, rows = store._send(ctx.route)
        out = []
        for (L, shape), dtype, r in zip(ctx.route[4], ctx.dtypes, rows):
            out.append(r.new_zeros((L,) + shape).index_add_(0, idx, r).to(dtype))
        return out[0], out[1], None, None, None, None


class ReplicaWeights:
    """One MoE layer's replica weights and the gradients its replicas gathered (see the module docstring).

    ``fetches`` / ``returns`` count the weight and gradient exchanges this layer has issued.
    """

    def __init__(self) -> None:
        self.in_step = False
        """Inside :func:`replica_step`: keep the fetched weights and the gradients until its end."""
        self.fetches = 0
        self.returns = 0
        self.routes = IndexCache()
        """The index tensors of the layer's table for the fetch and the return, built once per table."""
        self._kept: Optional[Tuple] = None  # (table, w1_Lr, w2_Lr, route) of the step
        self._sums: Optional[List[Optional[torch.Tensor]]] = None  # fp32 gradient sums [R, ...] per weight

    def weights(
        self, w1_L: torch.Tensor, w2_L: torch.Tensor, table: Sequence[int], *, ep_group, ep_size: int, ep_rank: int
    ):
        """``(w1_Lr, w2_Lr)``: the replica slots' weights for the owners' ``w1_L`` / ``w2_L`` under
        ``table``; their gradients reach the owners as the module docstring says. An all-empty table
        gives zeros without a gradient (nothing to fetch or return)."""
        table = tuple(table)
        R = len(table) // ep_size
        if all(e == EMPTY for e in table):
            return w1_L.new_zeros((R,) + tuple(w1_L.shape[1:])), w2_L.new_zeros((R,) + tuple(w2_L.shape[1:]))
        kept = self._kept if self.in_step else None
        if kept is not None and kept[0] != table:
            raise RuntimeError("the replica slot table changed inside a step; set it between steps")
        if kept is None:
            w1_Lr, w2_Lr = fetch_replica_weights(
                [w1_L, w2_L],
                table,
                ep_group=ep_group,
                ep_size=ep_size,
                ep_rank=ep_rank,
                num_replicas=R,
                cache=self.routes,
            )
            self.fetches += 1
            shapes = ((w1_L.shape[0], tuple(w1_L.shape[1:])), (w2_L.shape[0], tuple(w2_L.shape[1:])))
            kept = (table, w1_Lr, w2_Lr, (table, ep_group, ep_size, ep_rank, shapes, w1_Lr.device))
            if self.in_step:  # leaves of every use's graph: their gradients come to _StepUse
                self._kept = kept = (table, w1_Lr.requires_grad_(), w2_Lr.requires_grad_(), kept[3])
        _, w1_Lr, w2_Lr, route = kept
        if not torch.is_grad_enabled() or not (w1_L.requires_grad or w2_L.requires_grad):
            return w1_Lr.detach(), w2_Lr.detach()
        if self.in_step:
            return _StepUse.apply(w1_Lr, w2_Lr, self)
        return _ReplicaUse.apply(w1_L, w2_L, w1_Lr, w2_Lr, self, route)

    def _add(self, grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Add the replica slots' gradients of one use (``None``: not delivered by this call)."""
        if self._sums is None:
            self._sums = [None, None]
        for i, g in enumerate(grads):
            if g is None:
                continue
            g = g.to(torch.promote_types(g.dtype, torch.float32))
            self._sums[i] = g.clone() if self._sums[i] is None else self._sums[i].add_(g)

    def _send(self, route) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """Return the gathered sums to their owners (one exchange) and forget them."""
        table, ep_group, ep_size, ep_rank, shapes, device = route
        sums, self._sums = self._sums or [None, None], None
        dtype = next((s.dtype for s in sums if s is not None), torch.float32)
        R = len(table) // ep_size
        sums = [
            s if s is not None else torch.zeros((R,) + shape, dtype=dtype, device=device)
            for s, (_, shape) in zip(sums, shapes)
        ]
        self.returns += 1
        return return_replica_grads(
            sums,
            table,
            ep_group=ep_group,
            ep_size=ep_size,
            ep_rank=ep_rank,
            num_local_experts=shapes[0][0],
            cache=self.routes,
        )

    def begin_step(self) -> None:
        """Start a step: forget any kept weights (the parameters may have changed since)."""
        if self._sums is not None:
            raise RuntimeError("replica gradients of an earlier step were never returned to their owners")
        self.in_step, self._kept = True, None

    def end_step(self, owners: Sequence[torch.nn.Parameter]) -> None:
        """End a step: return the gathered gradients to ``owners`` (fc1, fc2: one exchange when the
        step fetched, zeros for a weight no backward reached) and drop the weights. Every rank of
        the EP group must call it (they all fetched, or none did: the table is the same on all)."""
        kept, self.in_step, self._kept = self._kept, False, None
        if kept is None:  # nothing fetched this step (an empty table): nothing to return
            self._sums = None
            return
        idx, rows = self._send(kept[3])
        for p, r in zip(owners, rows):
            _add_to_grad(p, idx, r)

    def abort_step(self) -> None:
        """Leave a step that failed: drop the weights and the gradients, without any collective."""
        self.in_step, self._kept, self._sums = False, None, None


def _add_to_grad(p: torch.nn.Parameter, idx: torch.Tensor, rows: torch.Tensor) -> None:
    """``index_add`` ``rows`` into ``p``'s gradient: ``.grad`` if it holds one, else the optimizer's
    ``main_grad`` (its backward hook has already moved ``.grad`` there), else a new ``.grad``."""
    with torch.no_grad():
        if p.grad is not None:
            p.grad.index_add_(0, idx, rows.to(p.grad.dtype))
        elif getattr(p, "main_grad", None) is not None:
            p.main_grad.index_add_(0, idx, rows.to(p.main_grad.dtype))
        else:
            p.grad = torch.zeros_like(p).index_add_(0, idx, rows.to(p.dtype))


@contextlib.contextmanager
def replica_step(stores: Iterable[Tuple[ReplicaWeights, Sequence[torch.nn.Parameter]]]):
    """One optimizer step's forwards and backwards (see the module docstring): ``stores`` pairs each
    layer's :class:`ReplicaWeights` with its owners' ``(fc1, fc2)``. On a normal exit the gradients
    are returned, in the given order (the same on every rank of a stage: one exchange per layer over
    its EP group); on an exception they are dropped without a collective."""
    stores = list(stores)
    for store, _ in stores:
        store.begin_step()
    try:
        yield
    except BaseException:
        for store, _ in stores:
            store.abort_step()
        raise
    for store, owners in stores:
        store.end_step(owners)
