"""Dense weight gradients computed behind the backward's next token exchange (``parallel.delay_wgrad``).

In a backward, a projection's input gradient is on the critical path (the layer below needs it) and its
weight gradient is not: nothing reads it before the optimizer. Megatron-Core's ``--delay-wgrad-compute``
therefore computes the weight-gradient GEMMs of attention and of the MLPs after the input gradients,
while the backward's next MoE exchange is in flight. ``parallel.delay_wgrad`` does the same: the
experts' GEMMs (:mod:`folding.moe.experts.backends`) and, through this module, every dense projection
of a layer (attention's query/key/value and output projections, MLA's down- and up-projections, the
shared expert's and a dense MLP's fc1 and fc2) queue their weight (and bias) gradients with
:func:`folding.overlap.runtime.defer`: they run inside the next :class:`~folding.overlap.exchange.Exchange`
wait of the backward (half before the other lane's piece, half after, in an overlap pair), or at the
end of the backward at the latest.

The deferred GEMMs are the calls torch's own ``linear`` backward makes (``gᵀ·x`` for the weight; the
input's ``g·W`` and the bias's row sum run at once, as torch folds them), on the same tensors, so the
gradients are bitwise those of the plain path; they reach the parameters through one ``torch.autograd.backward`` on
the weights as the forward used them (the *anchors*), so gradient hooks (the reducers') fire as usual.

- :func:`linear`: ``F.linear(x, w, b)`` with deferred weight and bias gradients (one rank, or the
  row-parallel GEMM before its reduce-scatter);
- :func:`defer_weight_grads`: defer the weight gradients of projections that share one input (the
  sequence-parallel gather of :mod:`folding.parallel.sequence_parallel` calls it);
- :func:`folded_mm`: a GEMM as ``torch.matmul`` computes it for a weight that needs a gradient (a
  detached weight must not change how the input gradient rounds); :func:`weight_grad`: the weight
  gradient's GEMM, deferred or not.

Usage::

    y = linear(x_SBH, weight, bias)           # in a module built with delay_wgrad=True
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .runtime import current_runtime, defer, entered


def folded_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [..., k] @ b [k, n]`` with ``a``'s leading dimensions folded into rows and one ``mm``: what
    ``torch.matmul`` does when ``b`` needs a gradient. For a ``b`` that needs none (a detached weight)
    and a non-contiguous ``a``, ``torch.matmul`` batches the product instead, which rounds differently:
    code that detaches a weight calls this to keep the numbers of the plain path."""
    if a.dim() <= 2:
        return a.mm(b)
    return a.reshape(-1, a.shape[-1]).mm(b).view(*a.shape[:-1], b.shape[-1])


def weight_grad(g_NO: torch.Tensor, x_NI: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``∂w = gᵀ·x`` of ``y = x·wᵀ`` in ``dtype``: torch's own mm backward for the column-major ``wᵀ``
    (``(xᵀ·g)ᵀ`` sums in another order). The one formula of the immediate and the deferred paths, so
    that deferring never changes a bit."""
    return g_NO.t().mm(x_NI).to(dtype)


def defer_weight_grads(
    x_NI: torch.Tensor,
    weights: Sequence[Tuple[torch.Tensor, torch.Tensor]],
    ready: Sequence[Tuple[Optional[torch.Tensor], torch.Tensor]] = (),
) -> None:
    """Queue the weight gradients of projections that read the same input ``x [N, in]``.

    ``weights``: ``(anchor, g [N, out])`` per projection: ``∂w`` (:func:`weight_grad`), cast to the
    anchor's dtype and delivered to the anchor (the tensor the forward
    multiplied by: a parameter, or its cast) when the deferred work runs
    (:func:`folding.overlap.runtime.defer`). ``ready``: ``(anchor, gradient)`` pairs computed already
    (the biases' row sums, cheap), delivered in the same ``torch.autograd.backward`` call. Anchors that
    are ``None`` or need no gradient are skipped; nothing is queued when none needs one."""
    live = [(w, g) for w, g in weights if w.requires_grad]
    done = [(b, gb) for b, gb in ready if b is not None and b.requires_grad]
    if not live and not done:
        return

    def run() -> None:
        tensors = [w for w, _ in live] + [b for b, _ in done]
        grads = [weight_grad(g_NO, x_NI, w.dtype) for w, g_NO in live] + [gb.to(b.dtype) for b, gb in done]
        torch.autograd.backward(tensors, grads)

    defer(run)


class _Linear(torch.autograd.Function):
    """``F.linear`` whose backward returns the input gradient and defers the weight and bias gradients."""

    @staticmethod
    def forward(ctx, x, w, b, anchors):
        ctx.save_for_backward(x, w)
        ctx.anchors = anchors  # (weight, bias) as the graph holds them: not autograd inputs
        ctx.overlap = current_runtime()  # the backward defers onto it (on CUDA it runs on another thread)
        # torch's linear for a weight that needs a gradient: the bias inside addmm on the folded rows when
        # x is 2-D or contiguous, else one mm on the folded rows and the bias added after it
        if b is not None and (x.dim() == 2 or x.is_contiguous()):
            return torch.addmm(b, x.reshape(-1, x.shape[-1]), w.t()).view(*x.shape[:-1], w.shape[0])
        y = folded_mm(x, w.t())
        return y if b is None else y.add_(b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        out, inp = w.shape
        g_NO = g.reshape(-1, out)  # as torch's linear folds it (a copy when g is not contiguous)
        # torch's own mm backward for the input: g·W on the folded rows
        gx = folded_mm(g, w) if ctx.needs_input_grad[0] else None
        aw, ab = ctx.anchors
        ready = ()
        if ab is not None and ab.requires_grad:
            # torch's linear adds the bias inside addmm on the folded rows when ``x`` is 2-D or contiguous
            # (the row sum of the folded gradient), else after the GEMM (a sum over g's leading dims)
            folded = x.dim() == 2 or x.is_contiguous()
            ready = ((ab, g_NO.sum(0) if folded else g.sum(tuple(range(g.dim() - 1)))),)
        with entered(ctx.overlap):
            defer_weight_grads(x.reshape(-1, inp), [(aw, g_NO)], ready)
        return gx, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose weight and bias gradients are computed behind the backward's
    next exchange (module docstring); the input gradient is computed at once. Without grad mode, when
    neither ``weight`` nor ``bias`` needs a gradient, or when ``x`` needs none (no backward would reach
    this node to queue them), it is plain ``F.linear``."""
    needs = weight.requires_grad or (bias is not None and bias.requires_grad)
    if not (torch.is_grad_enabled() and needs and x.requires_grad):
        return F.linear(x, weight, bias)
    b = None if bias is None else bias.detach()
    return _Linear.apply(x, weight.detach(), b, (weight, bias))


class WeightGradPieces:
    """The weight gradient of one GEMM that runs as several calls (a grouped GEMM split under the 32-bit
    index limit, :func:`folding.moe.experts.backends.plan_chunks`), delivered once per backward.

    Each call's backward hands in its piece with :meth:`add` (the tensor it reaches the weight through,
    and a function computing it); the first hand-in queues one deferred delivery on the runtime current
    when the pieces were made (the forward's: :func:`folding.overlap.runtime.defer`), or, outside every
    runtime, at the end of the backward (the autograd engine's callback queue). The calls' backward nodes
    run one after the other (their outputs are concatenated), so by the time an exchange or the end of
    the backward runs it, every piece is in: the pieces of one anchor are summed in hand-in order (the
    order autograd's own accumulation adds them in) and all anchors get their gradients in one
    ``torch.autograd.backward``, where they meet at the parameter's accumulation node: one gradient
    hook, one delivery to the gradient reducer (a second delivery after its bucket was reduced is an
    error there)."""

    def __init__(self) -> None:
        self._pieces: list = []
        self._runtime = current_runtime()  # made in the forward; a CUDA backward runs on another thread

    def add(self, anchor: torch.Tensor, compute) -> None:
        """Hand in the piece ``compute()`` of ``anchor``'s gradient (computed when the delivery runs); call it
        inside the backward."""
        self._pieces.append((anchor, compute))
        if len(self._pieces) > 1:
            return
        if self._runtime is None:  # no exchange will run it: the end of this backward does
            torch.autograd.Variable._execution_engine.queue_callback(self._deliver)
        else:
            with entered(self._runtime):
                defer(self._deliver)

    def _deliver(self) -> None:
        pieces, self._pieces = self._pieces, []
        anchors, grads = [], []
        for anchor, compute in pieces:
            g = compute()
            for i, a in enumerate(anchors):
                if a is anchor:
                    grads[i] = grads[i] + g
                    break
            else:
                anchors.append(anchor)
                grads.append(g)
        torch.autograd.backward(anchors, grads)
