"""The sequence-parallel all-gather fused with the column-parallel GEMMs that read it.

Under sequence parallelism each TP rank holds ``[S/TP, B, H]``; a TP block all-gathers it to
``[S, B, H]`` and feeds it to one or more column-parallel linears (Q/K/V; gate/up; a shared
expert's fc1). Autograd would keep the gathered ``[S, B, H]`` for the weight gradients: TP times
the shard, in every layer of every in-flight micro-batch. :func:`gather_linears` keeps only the
shard and gathers it again in backward, the way Megatron-Core's sequence-parallel linear does:

- Forward: all-gather ``x`` over TP along dim 0, then ``y_i = x_full W_iᵀ (+ b_i)`` for every weight.
- Backward: start the all-gather of ``x`` again, compute the input gradient ``Σ_i g_i W_i`` while it
  runs, then start the reduce-scatter (sum) of that gradient over TP (every rank holds a partial sum
  of the full input's gradient) and compute the weight gradients ``g_iᵀ x_full`` while it runs.

On one rank it is plain ``F.linear`` per weight (no custom autograd node). The collectives are
asynchronous (``async_op=True``): on GPU they run on the communication stream beside the GEMMs.

Usage::

    q, k, v = gather_linears(x_SBH, [wq, wk, wv], [bq, bk, bv], tp_group)   # each [S, B, out_i/TP]
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..overlap import wgrad
from ..overlap.runtime import current_runtime, entered
from .collectives import Group, all_gather_start, group_size, reduce_scatter_start


class _GatherLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, n_weights, anchors, *weights_and_biases):
        weights, biases = weights_and_biases[:n_weights], weights_and_biases[n_weights:]
        full, work = all_gather_start(x, group)
        work.wait()
        ctx.group = group
        ctx.has_bias = tuple(b is not None for b in biases)
        ctx.anchors = anchors  # delay_wgrad: (weights, biases) as the caller holds them, else None
        ctx.overlap = current_runtime()  # where the backward defers them (on CUDA it runs on another thread)
        ctx.save_for_backward(x, *weights)
        return tuple(
            F.linear(full, w.to(full.dtype), None if b is None else b.to(full.dtype)) for w, b in zip(weights, biases)
        )

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        full, gather = all_gather_start(x, ctx.group)  # re-gather, overlapped with dgrad
        dx = None
        for g, w in zip(grads, weights):
            d = wgrad.folded_mm(g, w.to(g.dtype))  # as matmul for a weight that needs a gradient, detached or not
            dx = d if dx is None else dx.add_(d)
        gather.wait()
        dx_local, scatter = reduce_scatter_start(dx, ctx.group)  # overlapped with wgrad
        full_2d = full.reshape(-1, full.shape[-1])
        if ctx.anchors is not None:  # behind the backward's next exchange (parallel.delay_wgrad)
            aw, ab = ctx.anchors
            g_2d = [g.reshape(-1, g.shape[-1]) for g in grads]
            ready = [(b, g.sum(0).to(w.dtype)) for b, g, w in zip(ab, g_2d, weights) if b is not None]
            with entered(ctx.overlap):
                wgrad.defer_weight_grads(full_2d, list(zip(aw, g_2d)), ready)
            scatter.wait()
            return (dx_local, None, None, None, *([None] * (2 * len(weights))))
        wgrads, bgrads = [], []
        for g, w, has_b in zip(grads, weights, ctx.has_bias):
            g_2d = g.reshape(-1, g.shape[-1])
            wgrads.append(wgrad.weight_grad(g_2d, full_2d, w.dtype))
            bgrads.append(g_2d.sum(0).to(w.dtype) if has_b else None)
        scatter.wait()
        return (dx_local, None, None, None, *wgrads, *bgrads)


def gather_linears(
    x_SBH: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Optional[Sequence[Optional[torch.Tensor]]],
    group: Group,
    *,
    delay_wgrad: bool = False,
) -> Tuple[torch.Tensor, ...]:
    """``F.linear(all_gather(x), W_i, b_i)`` for every weight, keeping only the shard ``x`` for backward.

    Forward: all-gather of ``x [S/TP, B, H]`` over ``group`` along dim 0, then one GEMM per weight
    ``W_i [out_i, H]`` (cast to ``x``'s dtype) giving ``[S, B, out_i]``. Backward: all-gather of ``x``
    again (overlapped with the input-gradient GEMMs), reduce-scatter (sum) of the input gradient over
    ``group`` (overlapped with the weight-gradient GEMMs). ``biases``: one per weight or ``None``.
    ``delay_wgrad`` (``parallel.delay_wgrad``): the weight and bias gradients are computed behind the
    backward's next exchange instead (:mod:`folding.overlap.wgrad`; the gathered input is kept until
    then), bitwise the same.
    """
    biases: List[Optional[torch.Tensor]] = list(biases) if biases is not None else [None] * len(weights)
    if len(biases) != len(weights):
        raise ValueError(f"gather_linears: {len(weights)} weights but {len(biases)} biases")
    if group_size(group) == 1:
        linear = wgrad.linear if delay_wgrad else F.linear
        return tuple(
            linear(x_SBH, w.to(x_SBH.dtype), None if b is None else b.to(x_SBH.dtype)) for w, b in zip(weights, biases)
        )
    needs = any(t is not None and t.requires_grad for t in (*weights, *biases))
    if delay_wgrad and torch.is_grad_enabled() and needs and x_SBH.requires_grad:
        # the weights enter detached; their gradients reach the caller's tensors when the deferred work runs
        detached = [None if t is None else t.detach() for t in (*weights, *biases)]
        return _GatherLinears.apply(x_SBH, group, len(weights), (tuple(weights), tuple(biases)), *detached)
    return _GatherLinears.apply(x_SBH, group, len(weights), None, *weights, *biases)
