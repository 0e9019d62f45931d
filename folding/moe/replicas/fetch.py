"""The replica weights of one forward, fetched from their owners over the EP group (autograd).

A replica slot is not a parameter: :func:`fetch_replica_weights` copies the owners' *current*
weights into this rank's replica slots each forward, and its backward returns the replicas' weight
gradients to the owners, where autograd adds them to the owner's own gradient before the
parameter's ``AccumulateGrad`` runs. So the parameter's gradient (and every hook, reduction,
ZeRO-1 shard, clipping and optimizer step after it) already holds the replicas' contributions, and
the updated weights reach the replicas at the next forward.

Collectives (both over ``ep_group``, one ``all_to_all_single`` each, sizes from the slot table that
every rank holds, so no count exchange):

- forward: every owner sends, to each EP rank, its experts that rank's replica slots name (slot
  order); each rank places what it receives into its slots (empty slots are zeros).
- backward: the reverse exchange: each rank sends its replica slots' gradients back to their owners,
  which sum them into their experts' gradients (``index_add``, one row per replica).

Under ETP the weight is this ETP rank's shard, and ``ep_group`` holds the ranks with the same ETP
index, so a replica is the same shard as its owner's.

Shape suffixes (docs/shapes.md): ``L`` local experts, ``Lr`` this rank's replica slots.

Usage::

    w1_Lr = fetch_replica_weights(
        experts.fc1_weight, table, ep_group=ps.groups.ep, ep_size=4, ep_rank=r, num_replicas=2
    )
"""

from __future__ import annotations

import functools
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from .table import EMPTY


@functools.lru_cache(maxsize=64)
def _route_tensors(table: Tuple[int, ...], ep_size: int, ep_rank: int, L: int, R: int, device: torch.device):
    """:func:`_routes` with the two index lists as tensors on ``device``, built once per table (no
    host→device copy per layer call)."""
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


class _FetchReplicas(torch.autograd.Function):
    """Forward: owners' experts → this rank's replica slots. Backward: slots' gradients summed into
    the owners' (see the module docstring)."""

    @staticmethod
    def forward(ctx, weight_L, table: Tuple[int, ...], ep_group, ep_size: int, ep_rank: int, R: int):
        L = weight_L.shape[0]
        idx, send_splits, slots, recv_splits = _route_tensors(table, ep_size, ep_rank, L, R, weight_L.device)
        send = weight_L.detach().index_select(0, idx).contiguous()
        recv = weight_L.new_empty((slots.numel(),) + tuple(weight_L.shape[1:]))
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=ep_group)
        out_Lr = weight_L.new_zeros((R,) + tuple(weight_L.shape[1:]))
        out_Lr.index_copy_(0, slots, recv)
        ctx.save_for_backward(idx, slots)
        ctx.meta = (ep_group, send_splits, recv_splits, L)
        return out_Lr

    @staticmethod
    def backward(ctx, grad_Lr):
        idx, slots = ctx.saved_tensors
        ep_group, send_splits, recv_splits, L = ctx.meta
        send = grad_Lr.index_select(0, slots).contiguous()
        recv = grad_Lr.new_empty((idx.numel(),) + tuple(grad_Lr.shape[1:]))
        dist.all_to_all_single(recv, send, send_splits, recv_splits, group=ep_group)
        grad_L = grad_Lr.new_zeros((L,) + tuple(grad_Lr.shape[1:]))
        grad_L.index_add_(0, idx, recv)
        return grad_L, None, None, None, None, None


def fetch_replica_weights(
    weight_L: torch.Tensor, table: Sequence[int], *, ep_group, ep_size: int, ep_rank: int, num_replicas: int
) -> torch.Tensor:
    """This rank's replica-slot weights ``[R, ...]`` (see the module docstring); ``weight_L`` is this
    rank's owned experts' weight ``[L, ...]``. Every rank of ``ep_group`` must call it with the same
    ``table``. An all-empty table returns zeros without any collective."""
    if all(e == EMPTY for e in table):
        return weight_L.new_zeros((num_replicas,) + tuple(weight_L.shape[1:]))
    return _FetchReplicas.apply(weight_L, tuple(table), ep_group, ep_size, ep_rank, num_replicas)
