"""The collectives of TP, SP, CP and the MoE code path, each on an explicit process group.

Every function states what it does in forward and in backward. All of them are the identity when
the group has one rank or ``torch.distributed`` is not initialized (no communication, same autograd
graph shape). The ``*_sequence_region`` functions act on dimension 0 (sequence parallelism, context
parallelism); :func:`all_gather_nograd`, :func:`all_reduce_nograd` and the ``*_start`` functions are
not autograd-aware, for counts, parameter storage and autograd functions that schedule their own
communication.

Usage::

    x_full = gather_from_sequence_region(x, tp_group)     # sequence-parallel entry of a TP region
    y = reduce_scatter_to_sequence_region(y_partial, tp_group)   # after a row-parallel linear
    counts_RE = all_gather_nograd(counts_E, ep_group, stack=True)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]

# torch 2.13 renamed the tensor-in/tensor-out collectives; these are the one place that picks the
# name this build has. Same arguments as torch's (``out, x, group=..., async_op=...``), no autograd.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather_single(out, x, group=..., async_op=False)``: equal-size all-gather concatenated on dim 0."""
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``reduce_scatter_single(out, x, group=..., async_op=False)``: sum over the group, rank i keeps chunk i."""


def group_size(group: Group) -> int:
    """Number of ranks in ``group`` (the world for ``None``; 1 when ``torch.distributed`` is not initialized)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group: Group) -> int:
    """This rank's index in ``group`` (0 when ``torch.distributed`` is not initialized)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


# --------------------------------------------------------------------------------------- raw ops
def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def all_gather_start(x: torch.Tensor, group: Group):
    """Start an all-gather of ``x`` along dim 0 over ``group`` (rank order); return ``(out, work)``.

    Not autograd-aware: for autograd functions that overlap the collective with their own GEMMs
    (:mod:`folding.parallel.sequence_parallel`); ``work.wait()`` before reading ``out``.
    """
    x = x.contiguous()
    out = torch.empty((group_size(group) * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, all_gather_single(out, x, group=group, async_op=True)


def gather_counts_start(x: torch.Tensor, group: Group):
    """Start an all-gather of a small tensor ``x`` (token counts) along dim 0 over ``group``; return
    ``(out, work)`` like :func:`all_gather_start` (same ``out``, rank order).

    On gloo it travels as one all-to-all of ``x`` repeated once per rank: gloo's all-gather is a ring
    (group size − 1 hops one after the other, each waiting for the next rank's progress thread to be
    scheduled), its all-to-all one round of direct messages, so on a host that time-slices its ranks
    the counts arrive after one scheduling delay instead of several (``docs/dispatcher.md`` has the
    measurement). Elsewhere (NCCL) it is the all-gather. Not autograd-aware.
    """
    n = group_size(group)
    if n == 1 or dist.get_backend(group) != "gloo":
        return all_gather_start(x, group)
    x = x.contiguous()
    out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, dist.all_to_all_single(out, x.repeat((n,) + (1,) * (x.dim() - 1)), group=group, async_op=True)


def reduce_scatter_start(x: torch.Tensor, group: Group):
    """Start a reduce-scatter (sum) of ``x`` along dim 0 over ``group``; return ``(out, work)``.

    Not autograd-aware, like :func:`all_gather_start`; dim 0 must divide by the group size.
    """
    n = group_size(group)
    if x.shape[0] % n:
        raise ValueError(f"dimension 0 of size {x.shape[0]} is not divisible by the group size {n}")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, reduce_scatter_single(out, x, group=group, async_op=True)


def all_gather_nograd(x: torch.Tensor, group: Group, *, stack: bool = False) -> torch.Tensor:
    """Forward only (no autograd): all-gather equal-size ``x`` over ``group`` in rank order,
    concatenated on dim 0, or along a new leading dim of size ``group_size`` when ``stack`` (so a
    1-rank group gives ``x.unsqueeze(0)``). Blocking; used for token counts and routing metadata."""
    n = group_size(group)
    if stack:
        x = x.unsqueeze(0)
    if n == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
    all_gather_single(out, x, group=group)
    return out


def all_reduce_nograd(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Forward only (no autograd): the sum of ``x`` over ``group``, in a new tensor (``x`` itself for
    a 1-rank group). Blocking; for autograd functions that reduce per-row statistics inside their own
    forward and backward (:func:`folding.model.norm.rms_norm`)."""
    return _all_reduce(x, group)


def _split0(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = group_size(group)
    if x.shape[0] % n:
        raise ValueError(f"dimension 0 of size {x.shape[0]} is not divisible by the group size {n}")
    return x.chunk(n, dim=0)[group_rank(group)].contiguous()


def _reduce_scatter0(x: torch.Tensor, group: Group) -> torch.Tensor:
    out, work = reduce_scatter_start(x, group)
    work.wait()
    return out


# ---------------------------------------------------------------------------- autograd wrappers
class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_reduce):
        ctx.group, ctx.grad_reduce = group, grad_reduce
        return all_gather_nograd(x, group)

    @staticmethod
    def backward(ctx, g):
        if ctx.grad_reduce:
            return _reduce_scatter0(g, ctx.group), None, None
        return _split0(g, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter0(x, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather_nograd(g, ctx.group), None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


def gather_from_sequence_region(x: torch.Tensor, group: Group, grad_reduce: bool = True) -> torch.Tensor:
    """Forward: all-gather along dimension 0.

    Backward: reduce-scatter (sum) of the gradient along dim 0 when ``grad_reduce`` (the consumer is
    tensor-parallel, so every rank holds a partial gradient of the full tensor); otherwise keep this
    rank's chunk of the gradient (the consumer is replicated).
    """
    return x if group_size(group) == 1 else _GatherFromSequenceRegion.apply(x, group, grad_reduce)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Forward: reduce-scatter (sum) along dimension 0. Backward: all-gather of the gradient on dim 0.

    Used after a row-parallel linear under sequence parallelism.
    """
    return x if group_size(group) == 1 else _ReduceScatterToSequenceRegion.apply(x, group)


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Forward: all-reduce (sum) over ``group``. Backward: all-reduce (sum) of the gradient.

    The gradient of a sum that every rank consumes fully (e.g. a loss term computed on every rank
    from a reduced statistic).
    """
    return x if group_size(group) == 1 else _AllReduceSum.apply(x, group)
