"""Vocab-parallel cross-entropy: per-token loss from logits sharded over the vocabulary.

Every TP rank holds logits ``[..., V/TP]`` for the same tokens. The loss
``logsumexp(logits) - logits[target]`` is computed with three all-reduces over TP of ``[...]``-sized
tensors (max, target logit, sum of exponentials); the full ``[..., V]`` logits never exist on one
rank. Backward needs no communication: each rank's gradient is ``softmax - onehot(target)``
restricted to its vocabulary slice, times the incoming gradient. Computed in fp32.

Usage::

    loss_SB = vocab_parallel_cross_entropy(logits_SBV_shard, targets_SB, tp_group)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.collectives import group_rank, group_size


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        logits = logits.float()
        tp = group_size(group)
        v_local = logits.shape[-1]
        start = group_rank(group) * v_local
        logits_max = logits.max(dim=-1).values
        if tp > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        outside = (target < start) | (target >= start + v_local)
        local_t = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        if tp > 1:
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=group)
            target_logit, sum_exp = both[0], both[1]
        loss = sum_exp.log() - target_logit
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, outside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -(~outside).unsqueeze(-1).to(grad.dtype))
        return grad * grad_loss.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group) -> torch.Tensor:
    """Per-token fp32 loss ``[...]`` from vocab-sharded ``logits [..., V/TP]`` and global ids ``target [...]``.

    Forward: all-reduce (max, then sum) over ``tp_group`` of per-token scalars. Backward: local only.
    """
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"targets {tuple(target.shape)} do not match logits {tuple(logits.shape)}[:-1]")
    return _VocabParallelCE.apply(logits, target, tp_group)
