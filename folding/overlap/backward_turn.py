"""A hand-over in the backward: the turn a backward lane gives where its forward read the token counts.

A forward lane of an overlap pair hands the baton over at three points per dropless MoE layer (the count
read, the dispatch exchange, the combine exchange); a backward lane waits on two exchanges per layer
(combine's and dispatch's backward). Were the backward lane to hand over only there, the forward's last
exchanges of every pair would find no backward left to hide behind. :func:`turn_in_backward` puts the
backward's third hand-over into the graph: an identity in the forward whose backward hands the baton to
the other lane (nothing of its own is in flight there, so the turn costs this lane nothing and gives the
forward lane a piece of backward compute to cover its next exchange). Outside a pair it does nothing.

Usage::

    x = turn_in_backward(x)   # in a forward; the backward hands over when x's gradient is ready
"""

from __future__ import annotations

import torch

from .runtime import current_runtime, entered


class _TurnInBackward(torch.autograd.Function):
    """Identity forward; backward: the kept runtime's lanes hand over (when a pair runs), then the
    gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.overlap = current_runtime()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        rt = ctx.overlap
        if rt is not None:
            with entered(rt):
                if rt.lanes.in_pair():
                    rt.lanes.hand_over()
        return grad


def turn_in_backward(x: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged; in the backward, a hand-over of the running pair when ``x``'s gradient is ready
    (module docstring). Identity without autograd or outside a runtime."""
    if not (torch.is_grad_enabled() and x.requires_grad) or current_runtime() is None:
        return x
    return _TurnInBackward.apply(x)
