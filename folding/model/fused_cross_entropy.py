"""Output layer fused with vocab-parallel cross-entropy, chunked over tokens: no full-batch logits.

``loss_T = fused_linear_cross_entropy(x_TH, weight_VH, target_T, tp_group, chunk_tokens=2048)`` equals
the cross-entropy of the TP-gathered logits ``F.linear(x_TH, weight_VH)`` (to round-off), but
only one chunk of ``chunk_tokens`` rows of fp32 logits ``[chunk, V/TP]`` exists at a time, in
forward and in backward. Forward keeps ``x_TH`` (which autograd holds anyway for the output layer)
and one fp32 log-sum-exp per token; backward recomputes each chunk's logits (one extra
``T·H·V/TP`` GEMM per step; when all tokens fit in one chunk its softmax is kept instead, which
costs no more than the chunk bound) and accumulates the gradients of ``x`` and of the weight chunk by
chunk. The unchunked path keeps ``[T, V/TP]`` logits plus the same-sized softmax: at Mixtral's
vocabulary (32000) and 8192 tokens per micro-batch that is 2 GiB in fp32, here 0.5 GiB per 2048-token
chunk, transient.

Collectives (each forward chunk, over ``tp_group``; none when it has one rank): all-reduce MAX of the
per-token logit maximum, all-reduce SUM of the per-token target logit and sum of exponentials.
Backward: none (each rank's gradient is ``softmax − onehot`` on its vocabulary slice).

Shape suffixes (docs/shapes.md): ``T`` tokens, ``H`` hidden, ``V`` this rank's vocabulary slice
(V/TP), ``Tc`` the tokens of one chunk.

Usage::

    loss_T = fused_linear_cross_entropy(hidden_TH, output_weight, labels_T, tp_group)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..parallel.collectives import group_rank, group_size


def mask_padding(logits_TV: torch.Tensor, start: int, vocab_size: int) -> torch.Tensor:
    """``logits_TV`` (the vocabulary slice whose first global id is ``start``) with the columns of the
    padded rows (ids ``>= vocab_size``, ``model.make_vocab_size_divisible_by``) set to ``-inf`` in
    place: they are never predicted and get no gradient."""
    pad = start + logits_TV.shape[-1] - vocab_size
    if pad > 0:
        logits_TV[..., max(0, vocab_size - start) :] = float("-inf")
    return logits_TV


def _logits(x_TcH, w_VH, start, vocab_size):
    """fp32 logits of one chunk, padded columns at ``-inf``."""
    return mask_padding((x_TcH @ w_VH.t()).float(), start, vocab_size)


def _chunk_stats(x_TcH, w_VH, target_Tc, start, group, vocab_size):
    """fp32 logits of one chunk, their per-token max-shifted log-sum-exp and target logit (all reduced)."""
    logits_TcV = _logits(x_TcH, w_VH, start, vocab_size)
    v_local = logits_TcV.shape[-1]
    max_Tc = logits_TcV.max(dim=-1).values
    if group_size(group) > 1:
        dist.all_reduce(max_Tc, op=dist.ReduceOp.MAX, group=group)
    outside_Tc = (target_Tc < start) | (target_Tc >= start + v_local)
    local_t_Tc = (target_Tc - start).masked_fill(outside_Tc, 0)
    target_logit_Tc = logits_TcV.gather(-1, local_t_Tc.unsqueeze(-1)).squeeze(-1).masked_fill(outside_Tc, 0.0)
    sum_exp_Tc = (logits_TcV - max_Tc.unsqueeze(-1)).exp_().sum(-1)
    if group_size(group) > 1:
        both = torch.stack([target_logit_Tc, sum_exp_Tc])
        dist.all_reduce(both, group=group)
        target_logit_Tc, sum_exp_Tc = both[0], both[1]
    lse_Tc = sum_exp_Tc.log() + max_Tc
    return logits_TcV, lse_Tc, target_logit_Tc, local_t_Tc, outside_Tc


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w_VH, target_T, group, chunk, vocab_size):
        start = group_rank(group) * w_VH.shape[0]
        loss_T = torch.empty(x_TH.shape[0], dtype=torch.float32, device=x_TH.device)
        lse_T = torch.empty_like(loss_T)
        softmax_TV = None
        for c0 in range(0, x_TH.shape[0], chunk):
            sl = slice(c0, c0 + chunk)
            logits_TcV, lse_Tc, tl_Tc, _, _ = _chunk_stats(x_TH[sl], w_VH, target_T[sl], start, group, vocab_size)
            lse_T[sl], loss_T[sl] = lse_Tc, lse_Tc - tl_Tc
            if x_TH.shape[0] <= chunk:  # one chunk: keep its softmax, backward needs no recompute GEMM
                softmax_TV = logits_TcV.sub_(lse_Tc.unsqueeze(-1)).exp_()
        ctx.softmax_TV = softmax_TV
        ctx.save_for_backward(x_TH, w_VH, target_T, lse_T)
        ctx.start, ctx.chunk, ctx.vocab_size = start, chunk, vocab_size
        return loss_T

    @staticmethod
    def backward(ctx, grad_T):
        x_TH, w_VH, target_T, lse_T = ctx.saved_tensors
        start, chunk = ctx.start, ctx.chunk
        grad_x = torch.empty_like(x_TH) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(w_VH.shape, dtype=torch.float32, device=w_VH.device) if ctx.needs_input_grad[1] else None
        v_local = w_VH.shape[0]
        for c0 in range(0, x_TH.shape[0], chunk):
            sl = slice(c0, c0 + chunk)
            x_TcH, t_Tc = x_TH[sl], target_T[sl]
            if ctx.softmax_TV is not None:  # kept (one chunk)
                g_TcV = ctx.softmax_TV
            else:  # recomputed
                g_TcV = _logits(x_TcH, w_VH, start, ctx.vocab_size).sub_(lse_T[sl].unsqueeze(-1)).exp_()
            inside_Tc = (t_Tc >= start) & (t_Tc < start + v_local)
            rows = torch.nonzero(inside_Tc).squeeze(-1)
            g_TcV[rows, t_Tc[rows] - start] -= 1.0  # − onehot
            g_TcV.mul_(grad_T[sl].unsqueeze(-1))
            if grad_x is not None:
                grad_x[sl] = g_TcV.to(x_TH.dtype) @ w_VH
            if grad_w is not None:
                grad_w.addmm_(g_TcV.t(), x_TcH.float())
        ctx.softmax_TV = None
        return grad_x, (grad_w.to(w_VH.dtype) if grad_w is not None else None), None, None, None, None


def fused_linear_cross_entropy(
    x_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    target_T: torch.Tensor,
    tp_group,
    chunk_tokens: int = 2048,
    vocab_size: Optional[int] = None,
) -> torch.Tensor:
    """Per-token fp32 loss ``[T]`` of the output layer ``x_TH · weight_VHᵀ`` (vocab-sharded over
    ``tp_group``) against global ids ``target_T``, ``chunk_tokens`` tokens at a time (module docstring).
    ``vocab_size``: the real vocabulary when the weight's rows are padded beyond it (the padded ids'
    logits are ``-inf``: never predicted, no gradient); ``None``: every row is a token."""
    if x_TH.dim() != 2 or weight_VH.dim() != 2 or x_TH.shape[1] != weight_VH.shape[1]:
        raise ValueError(
            f"fused_linear_cross_entropy: x {tuple(x_TH.shape)} and weight {tuple(weight_VH.shape)} "
            "must be [T, H] and [V/TP, H]"
        )
    if target_T.shape != x_TH.shape[:1]:
        raise ValueError(f"fused_linear_cross_entropy: targets {tuple(target_T.shape)} must be [T={x_TH.shape[0]}]")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    if vocab_size is None:
        vocab_size = weight_VH.shape[0] * group_size(tp_group)
    return _FusedLinearCE.apply(x_TH, weight_VH, target_T, tp_group, int(chunk_tokens), int(vocab_size))
