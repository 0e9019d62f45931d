"""Autograd-aware collectives used by TP, SP, CP and EP, each on an explicit process group.

Every function states what it does in forward and in backward. All of them are the identity when
the group has one rank (no communication, same autograd graph shape). ``dim`` defaults follow their
use: ``*_region`` functions act on the last dimension (tensor-parallel hidden split),
``*_sequence_region`` functions on dimension 0 (sequence parallelism and token exchange).

Usage::

    y = copy_to_region(x, tp_group)              # before a column-parallel linear
    z = reduce_scatter_to_sequence_region(y, tp_group)   # after a row-parallel linear under SP
    out = all_to_all(tokens, ep_group, output_split_sizes=recv, input_split_sizes=send)
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]

# torch 2.13 renamed the tensor-in/tensor-out collectives; use whichever this build has.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: Group) -> int:
    """Number of ranks in ``group`` (the world for ``None``)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group: Group) -> int:
    """This rank's index in ``group``."""
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
    return out, _all_gather_single(out, x, group=group, async_op=True)


def reduce_scatter_start(x: torch.Tensor, group: Group):
    """Start a reduce-scatter (sum) of ``x`` along dim 0 over ``group``; return ``(out, work)``.

    Not autograd-aware, like :func:`all_gather_start`; dim 0 must divide by the group size.
    """
    n = group_size(group)
    if x.shape[0] % n:
        raise ValueError(f"dimension 0 of size {x.shape[0]} is not divisible by the group size {n}")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, _reduce_scatter_single(out, x, group=group, async_op=True)


def _all_gather(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    out, work = all_gather_start(x.movedim(dim, 0), group)
    work.wait()
    if dim % x.dim() == 0:
        return out
    return torch.cat([c.movedim(0, dim) for c in out.chunk(n, dim=0)], dim=dim)


def _split(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the group size {n}")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the group size {n}")
    out, work = reduce_scatter_start(x.movedim(dim, 0), group)
    work.wait()
    return out.movedim(0, dim)


def _all_to_all(
    x: torch.Tensor, group: Group, out_splits: Optional[Sequence[int]], in_splits: Optional[Sequence[int]]
) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    if out_splits is None:
        out = torch.empty_like(x)
    else:
        out = torch.empty((int(sum(out_splits)),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(
        out,
        x,
        output_split_sizes=None if out_splits is None else list(out_splits),
        input_split_sizes=None if in_splits is None else list(in_splits),
        group=group,
    )
    return out


def _all_gather_v(x: torch.Tensor, group: Group, sizes: Sequence[int]) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    me = group_rank(group)
    if x.shape[0] != sizes[me]:
        raise ValueError(f"all_gather_v: local rows {x.shape[0]} != sizes[{me}]={sizes[me]}")
    send = x.unsqueeze(0).expand((n,) + tuple(x.shape)).reshape((n * x.shape[0],) + tuple(x.shape[1:]))
    return _all_to_all(send, group, list(sizes), [x.shape[0]] * n)


def _reduce_scatter_v(x: torch.Tensor, group: Group, sizes: Sequence[int]) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    me = group_rank(group)
    recv = _all_to_all(x, group, [sizes[me]] * n, list(sizes))
    return recv.view((n, sizes[me]) + tuple(x.shape[1:])).sum(0)


# ---------------------------------------------------------------------------- autograd wrappers
class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group, ctx.dim), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, grad_reduce):
        ctx.group, ctx.dim, ctx.grad_reduce = group, dim, grad_reduce
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        if ctx.grad_reduce:
            return _reduce_scatter(g, ctx.group, ctx.dim), None, None, None
        return _split(g, ctx.group, ctx.dim), None, None, None


class _ReduceScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group, ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return _all_to_all(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


class _AllGatherV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _all_gather_v(x, group, sizes)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_v(g, ctx.group, ctx.sizes), None, None


class _ReduceScatterV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _reduce_scatter_v(x, group, sizes)

    @staticmethod
    def backward(ctx, g):
        return _all_gather_v(g, ctx.group, ctx.sizes), None, None


# ------------------------------------------------------------------------------------ public API
def copy_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce (sum) of the gradient over ``group``.

    Used where a replicated input enters a column-parallel region.
    """
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Forward: all-reduce (sum) over ``group``. Backward: identity.

    Used after a row-parallel linear without sequence parallelism.
    """
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Forward: keep this rank's chunk of ``dim`` (split in group-size equal parts).
    Backward: all-gather of the gradient along ``dim``."""
    return x if group_size(group) == 1 else _ScatterToRegion.apply(x, group, dim)


def gather_from_region(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Forward: all-gather along ``dim`` (rank order). Backward: keep this rank's gradient chunk."""
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group, dim, False)


def scatter_to_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Forward: keep this rank's chunk of dimension 0. Backward: all-gather of the gradient on dim 0."""
    return scatter_to_region(x, group, 0)


def gather_from_sequence_region(x: torch.Tensor, group: Group, grad_reduce: bool = True) -> torch.Tensor:
    """Forward: all-gather along dimension 0.

    Backward: reduce-scatter (sum) of the gradient along dim 0 when ``grad_reduce`` (the consumer is
    tensor-parallel, so every rank holds a partial gradient of the full tensor); otherwise keep this
    rank's chunk of the gradient (the consumer is replicated).
    """
    return x if group_size(group) == 1 else _GatherFromRegion.apply(x, group, 0, grad_reduce)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Forward: reduce-scatter (sum) along dimension 0. Backward: all-gather of the gradient on dim 0.

    Used after a row-parallel linear under sequence parallelism.
    """
    return x if group_size(group) == 1 else _ReduceScatterToRegion.apply(x, group, 0)


def all_to_all(
    x: torch.Tensor,
    group: Group,
    output_split_sizes: Optional[List[int]] = None,
    input_split_sizes: Optional[List[int]] = None,
) -> torch.Tensor:
    """Forward: ``all_to_all_single`` along dim 0 with (possibly uneven) split sizes.

    Backward: the reverse all-to-all of the gradient (input and output split sizes swapped).
    """
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, output_split_sizes, input_split_sizes)


def all_gather_v(x: torch.Tensor, group: Group, sizes: List[int]) -> torch.Tensor:
    """Forward: all-gather along dim 0 where rank ``i`` contributes ``sizes[i]`` rows (uneven).

    Backward: reduce-scatter-v: each rank receives, summed over the group, the gradient of its rows.
    """
    return x if group_size(group) == 1 else _AllGatherV.apply(x, group, list(sizes))


def reduce_scatter_v(x: torch.Tensor, group: Group, sizes: List[int]) -> torch.Tensor:
    """Forward: sum over the group, then rank ``i`` keeps rows ``[sum(sizes[:i]), sum(sizes[:i+1]))``.

    Backward: all-gather-v of the gradient (each rank's rows to every rank).
    """
    return x if group_size(group) == 1 else _ReduceScatterV.apply(x, group, list(sizes))


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Forward: all-reduce (sum) over ``group``. Backward: all-reduce (sum) of the gradient.

    The gradient of a sum that every rank consumes fully (e.g. a loss term computed on every rank
    from a reduced statistic).
    """
    return x if group_size(group) == 1 else _AllReduceSum.apply(x, group)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None
