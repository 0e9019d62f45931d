"""Fused SwiGLU with the router-probability multiply: ``silu(gate) ⊙ up ⊙ p`` in one autograd node.

Unfused, autograd keeps ``gate``, ``up``, ``silu(gate)``, ``silu(gate) ⊙ up`` and the broadcast
probabilities alive for backward, and backward runs a chain of small elementwise kernels plus a
``cat`` of the two halves' gradients. The fused node saves only fc1's output ``h_NF2`` and
``probs_N``, recomputes ``silu(gate)`` in backward (aten's ``silu_backward`` forms ``silu'``), and
writes the gradient of both halves into one ``[N, 2F]`` tensor: less activation memory and fewer
passes over ``[N, F]`` data.

Shape-suffix legend: ``N`` rows (tokens after dispatch, expert-major), ``F`` the FFN width this rank
holds (its ETP shard, ``Fl`` in experts.py), ``F2`` = 2·F (``[gate | up]`` side by side, the layout of
fc1's output).

Usage::

    act_NF = swiglu_prob(h_NF2, probs_N)      # == F.silu(gate) * up * probs_N[:, None]
"""

from __future__ import annotations

import torch


class _SwiGLUProb(torch.autograd.Function):
    """Forward: ``silu(h[:, :F]) * h[:, F:] * p[:, None]``. Backward: gradients of ``h`` and ``p``."""

    @staticmethod
    def forward(ctx, h_NF2: torch.Tensor, probs_N: torch.Tensor):
        f = h_NF2.shape[-1] // 2
        gate_NF, up_NF = h_NF2[:, :f], h_NF2[:, f:]
        p_N1 = probs_N.to(h_NF2.dtype).unsqueeze(-1)
        ctx.save_for_backward(h_NF2, probs_N)
        return torch.nn.functional.silu(gate_NF).mul_(up_NF).mul_(p_N1)

    @staticmethod
    def backward(ctx, grad_NF: torch.Tensor):
        h_NF2, probs_N = ctx.saved_tensors
        f = h_NF2.shape[-1] // 2
        gate_NF, up_NF = h_NF2[:, :f], h_NF2[:, f:]
        p_N1 = probs_N.to(h_NF2.dtype).unsqueeze(-1)
        grad_NF = grad_NF.contiguous()
        grad_h_NF2 = torch.empty_like(h_NF2)
        # Eight passes over [N, F] data, two fresh [N, F] buffers: each large temporary costs page
        # faults on a CPU allocator, so the products are formed in place where they can be.
        silu_NF = torch.nn.functional.silu(gate_NF)
        gu_NF = torch.mul(grad_NF, up_NF)  # grad · up
        grad_p_N = None
        if ctx.needs_input_grad[1]:
            # d/dp = sum over F of grad · up · silu(gate)
            grad_p_N = torch.mul(gu_NF, silu_NF).sum(-1).to(probs_N.dtype)
        # d/d gate = grad · p · up · silu'(gate): aten's fused silu_backward forms silu'
        torch.ops.aten.silu_backward.grad_input(gu_NF.mul_(p_N1), gate_NF, grad_input=grad_h_NF2[:, :f])
        # d/d up = grad · p · silu(gate)
        torch.mul(grad_NF, silu_NF.mul_(p_N1), out=grad_h_NF2[:, f:])
        return grad_h_NF2, grad_p_N


def swiglu_prob(h_NF2: torch.Tensor, probs_N: torch.Tensor) -> torch.Tensor:
    """``silu(gate) ⊙ up ⊙ probs`` from fc1's output ``h_NF2 = [gate | up]`` ``[N, 2F]`` and ``probs_N [N]``.

    Equal to ``F.silu(h[:, :F]) * h[:, F:] * probs_N[:, None]`` in forward and backward (to
    round-off); the result has ``h_NF2``'s dtype.
    """
    if h_NF2.dim() != 2 or h_NF2.shape[-1] % 2:
        raise ValueError(f"swiglu_prob: h_NF2 must be [N, 2F] (gate and up side by side), got {tuple(h_NF2.shape)}")
    if probs_N.shape != h_NF2.shape[:1]:
        raise ValueError(f"swiglu_prob: probs_N must be [N={h_NF2.shape[0]}], got {tuple(probs_N.shape)}")
    return _SwiGLUProb.apply(h_NF2, probs_N)
