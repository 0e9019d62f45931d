"""Autograd collectives for the tests' reference models only (the engine does not use them).

The oracles (the reference MoE of ``tests/unit/test_model_reference_moe.py``, the hand-written
folded model of ``tests/distributed/test_grad_reduction.py``) exchange tokens with the plainest
algorithms: an all-gather-v is an all-to-all of copies, a reduce-scatter-v an all-to-all then a sum.
Every function is the identity on a 1-rank group or without ``torch.distributed``; each states its
forward and backward.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from folding.parallel.collectives import all_gather_nograd, group_rank, group_size


def _a2a(x: torch.Tensor, group, out_splits: Sequence[int], in_splits: Sequence[int]) -> torch.Tensor:
    out = x.new_empty((int(sum(out_splits)),) + tuple(x.shape[1:]))
    dist.all_to_all_single(
        out, x.contiguous(), output_split_sizes=list(out_splits), input_split_sizes=list(in_splits), group=group
    )
    return out


def _gather_v(x, group, sizes):
    n = group_size(group)
    send = x.unsqueeze(0).expand((n,) + tuple(x.shape)).reshape((n * x.shape[0],) + tuple(x.shape[1:]))
    return _a2a(send, group, sizes, [x.shape[0]] * n)


def _scatter_v(x, group, sizes):
    n, me = group_size(group), group_rank(group)
    recv = _a2a(x, group, [sizes[me]] * n, sizes)
    return recv.view((n, sizes[me]) + tuple(x.shape[1:])).sum(0)


def _sum(x, group):
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return _a2a(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, g):
        return _a2a(g, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


class _GatherV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _gather_v(x, group, sizes)

    @staticmethod
    def backward(ctx, g):
        return _scatter_v(g, ctx.group, ctx.sizes), None, None


class _ScatterV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _scatter_v(x, group, sizes)

    @staticmethod
    def backward(ctx, g):
        return _gather_v(g, ctx.group, ctx.sizes), None, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _sum(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_nograd(x.movedim(-1, 0).contiguous(), group).movedim(0, -1).contiguous()

    @staticmethod
    def backward(ctx, g):
        return g.chunk(group_size(ctx.group), dim=-1)[group_rank(ctx.group)].contiguous(), None


def _single(group) -> bool:
    return group_size(group) == 1


def all_to_all(x, group, output_split_sizes: List[int], input_split_sizes: List[int]) -> torch.Tensor:
    """Forward: uneven all-to-all along dim 0. Backward: the reverse all-to-all of the gradient."""
    return x if _single(group) else _AllToAll.apply(x, group, list(output_split_sizes), list(input_split_sizes))


def all_gather_v(x, group, sizes: List[int]) -> torch.Tensor:
    """Forward: all-gather along dim 0, rank i contributing ``sizes[i]`` rows. Backward: reduce-scatter-v."""
    return x if _single(group) else _GatherV.apply(x, group, list(sizes))


def reduce_scatter_v(x, group, sizes: List[int]) -> torch.Tensor:
    """Forward: sum over the group, rank i keeps its ``sizes[i]`` rows. Backward: all-gather-v."""
    return x if _single(group) else _ScatterV.apply(x, group, list(sizes))


def reduce_from_region(x, group) -> torch.Tensor:
    """Forward: all-reduce (sum). Backward: identity."""
    return x if _single(group) else _ReduceFrom.apply(x, group)


def gather_from_region(x, group) -> torch.Tensor:
    """Forward: all-gather along the last dim (rank order). Backward: this rank's chunk of the gradient."""
    return x if _single(group) else _GatherLast.apply(x, group)


def domain_gather_v(x: torch.Tensor, etp_group, ep_group, count: Optional[int] = None):
    """All-gather-v of ``x``'s rows over the ETP×EP domain: over ETP, then over EP. Returns
    ``(gathered, (etp_sizes, ep_sizes))`` for :func:`domain_reduce_scatter_v`, which reverses it."""
    rows = torch.tensor([x.shape[0] if count is None else count])
    etp_sizes = [int(v) for v in all_gather_nograd(rows, etp_group)]
    ep_sizes = [int(v) for v in all_gather_nograd(torch.tensor([sum(etp_sizes)]), ep_group)]
    return all_gather_v(all_gather_v(x, etp_group, etp_sizes), ep_group, ep_sizes), (etp_sizes, ep_sizes)


def domain_reduce_scatter_v(x: torch.Tensor, etp_group, ep_group, sizes) -> torch.Tensor:
    """The reverse of :func:`domain_gather_v`: reduce-scatter-v over EP, then over ETP."""
    etp_sizes, ep_sizes = sizes
    return reduce_scatter_v(reduce_scatter_v(x, ep_group, ep_sizes), etp_group, etp_sizes)
