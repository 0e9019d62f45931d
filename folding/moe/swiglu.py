"""Fused SwiGLU with the router-probability multiply: ``silu(gate) ⊙ up ⊙ p`` in one autograd node.

Unfused, autograd keeps ``gate``, ``up``, ``silu(gate)``, ``silu(gate) ⊙ up`` and the broadcast
probabilities alive for backward, and backward runs a chain of small elementwise kernels plus a
``cat`` of the two halves' gradients. The fused node saves only fc1's output ``h_NF2`` and
``probs_N``, recomputes ``sigmoid(gate)`` in backward, and writes the gradient of both halves into
one ``[N, 2F]`` tensor: less activation memory and fewer passes over ``[N, F]`` data.

Shape-suffix legend: ``N`` rows (tokens after dispatch, expert-major), ``F`` the FFN width of this
rank's shard, ``F2`` = 2·F (``[gate | up]`` side by side, the layout of fc1's output).

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
        sig_NF = torch.sigmoid(gate_NF)
        silu_NF = gate_NF * sig_NF
        grad_h_NF2 = torch.empty_like(h_NF2)
        grad_p_N = None
        if ctx.needs_input_grad[1]:
            # d/dp: sum over F of grad · silu(gate) · up
            grad_p_N = (grad_NF * silu_NF * up_NF).sum(-1).to(probs_N.dtype)
        g_NF = grad_NF * p_N1                                      # gradient of silu(gate) ⊙ up
        torch.mul(g_NF, silu_NF, out=grad_h_NF2[:, f:])            # d/d up = g · silu(gate)
        # d/d gate = g · up · silu'(gate), silu'(x) = sig(x) · (1 + x · (1 − sig(x)))
        dsilu_NF = sig_NF.mul_(1.0 + gate_NF * (1.0 - sig_NF))
        torch.mul(g_NF.mul_(up_NF), dsilu_NF, out=grad_h_NF2[:, :f])
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
