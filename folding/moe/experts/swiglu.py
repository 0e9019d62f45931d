"""Fused SwiGLU with the router-probability multiply: ``silu(gate) ⊙ up ⊙ p`` in one autograd node.

Unfused, autograd keeps ``gate``, ``up``, ``silu(gate)``, ``silu(gate) ⊙ up`` and the broadcast
probabilities alive for backward, and backward runs a chain of small elementwise kernels plus a
``cat`` of the two halves' gradients. The fused node saves only fc1's output ``h_NFl2`` and
``probs_N``, recomputes ``silu(gate)`` in backward (aten's ``silu_backward`` forms ``silu'``), and
writes the gradient of both halves into one ``[N, 2·Fl]`` tensor: less activation memory and fewer
passes over ``[N, Fl]`` data.

``fp8_store`` (``moe.fp8_act_input_store``, Megatron-Core's ``activation_func_fp8_input_store``): the
node keeps fc1's output as e4m3 codes with the FP8 recipe's scaling along the features
(:func:`folding.quant.quantize_operand`: one float32 per tensor for ``delayed`` and ``tensorwise``,
current scaling; per 1×128 block for ``blockwise``, per 32 for ``mxfp8`` (E8M0), per row for
``rowwise``) instead of the high-precision tensor, 1 byte per element plus scales; the forward uses the
exact input, the backward the decoded one, so the gradients see the FP8-rounded input (as Megatron's,
whose fused kernel casts without a scale).

Shape suffixes (docs/shapes.md): ``N`` rows (tokens after dispatch, expert-major), ``Fl`` the FFN
width this rank holds (its ETP shard of ``F``), ``Fl2`` = 2·Fl (``[gate | up]`` side by side, the
layout of fc1's output).

:func:`swiglu` is the same without probabilities, for the dense MLPs and the shared expert, whose
gate and up are two tensors (or two halves of one): it keeps them and nothing else (autograd's
``F.silu(gate) * up`` would also keep ``silu(gate)``).

Usage::

    act_NFl = swiglu_prob(h_NFl2, probs_N)      # == F.silu(gate) * up * probs_N[:, None]
    act_NFl = swiglu_prob(h_NFl2, probs_N, fp8_store="mxfp8")   # keeps h_NFl2 in MXFP8 for backward
    act = swiglu(gate, up)                      # == F.silu(gate) * up, any shape
"""

from __future__ import annotations

from typing import Optional

import torch

from folding.quant.operand import quantize_operand


class _SwiGLUProb(torch.autograd.Function):
    """Forward: ``silu(h[:, :Fl]) * h[:, Fl:] * p[:, None]``. Backward: gradients of ``h`` and ``p``, from
    ``h`` as kept (its FP8 codes and scales under ``fp8_store``)."""

    @staticmethod
    def forward(ctx, h_NFl2: torch.Tensor, probs_N: torch.Tensor, fp8_store: Optional[str]):
        f = h_NFl2.shape[-1] // 2
        gate_NFl, up_NFl = h_NFl2[:, :f], h_NFl2[:, f:]
        p_N1 = probs_N.to(h_NFl2.dtype).unsqueeze(-1)
        if fp8_store is None:
            ctx.h_op = None
            ctx.save_for_backward(h_NFl2, None, probs_N)
        else:
            op = quantize_operand(h_NFl2.detach(), fp8_store, "input", -1)
            ctx.h_op = op.stripped()
            ctx.save_for_backward(*op.tensors, probs_N)
        return torch.nn.functional.silu(gate_NFl).mul_(up_NFl).mul_(p_N1)

    @staticmethod
    def backward(ctx, grad_NFl: torch.Tensor):
        h_NFl2, h_scale, probs_N = ctx.saved_tensors
        if ctx.h_op is not None:
            h_NFl2 = ctx.h_op.with_tensors(h_NFl2, h_scale).dequantize()
        f = h_NFl2.shape[-1] // 2
        gate_NFl, up_NFl = h_NFl2[:, :f], h_NFl2[:, f:]
        p_N1 = probs_N.to(h_NFl2.dtype).unsqueeze(-1)
        grad_NFl = grad_NFl.contiguous()
        grad_h_NFl2 = torch.empty_like(h_NFl2)
        # Eight passes over [N, Fl] data, two fresh [N, Fl] buffers: each large temporary costs page
        # faults on a CPU allocator, so the products are formed in place where they can be.
        silu_NFl = torch.nn.functional.silu(gate_NFl)
        gu_NFl = torch.mul(grad_NFl, up_NFl)  # grad · up
        grad_p_N = None
        if ctx.needs_input_grad[1]:
            # d/dp = sum over F of grad · up · silu(gate)
            grad_p_N = torch.mul(gu_NFl, silu_NFl).sum(-1).to(probs_N.dtype)
        # d/d gate = grad · p · up · silu'(gate): aten's fused silu_backward forms silu'
        torch.ops.aten.silu_backward.grad_input(gu_NFl.mul_(p_N1), gate_NFl, grad_input=grad_h_NFl2[:, :f])
        # d/d up = grad · p · silu(gate)
        torch.mul(grad_NFl, silu_NFl.mul_(p_N1), out=grad_h_NFl2[:, f:])
        return grad_h_NFl2, grad_p_N, None


def swiglu_prob(h_NFl2: torch.Tensor, probs_N: torch.Tensor, fp8_store: Optional[str] = None) -> torch.Tensor:
    """``silu(gate) ⊙ up ⊙ probs`` from fc1's output ``h_NFl2 = [gate | up]`` ``[N, 2·Fl]`` and ``probs_N [N]``.

    Equal to ``F.silu(h[:, :Fl]) * h[:, Fl:] * probs_N[:, None]`` in forward and backward (to
    round-off); the result has ``h_NFl2``'s dtype. ``fp8_store``: an FP8 recipe name to keep ``h_NFl2``
    for backward in that recipe's FP8 (module docstring; the forward is unchanged, the gradients see the
    rounded input); ``None`` keeps it as is.
    """
    if h_NFl2.dim() != 2 or h_NFl2.shape[-1] % 2:
        raise ValueError(f"swiglu_prob: h_NFl2 must be [N, 2F] (gate and up side by side), got {tuple(h_NFl2.shape)}")
    if probs_N.shape != h_NFl2.shape[:1]:
        raise ValueError(f"swiglu_prob: probs_N must be [N={h_NFl2.shape[0]}], got {tuple(probs_N.shape)}")
    return _SwiGLUProb.apply(h_NFl2, probs_N, fp8_store)


class _SwiGLU(torch.autograd.Function):
    """Forward: ``silu(gate) * up``. Backward: the gradients of ``gate`` and ``up``, from the two inputs
    it keeps (``silu(gate)`` is recomputed)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor):
        ctx.save_for_backward(gate, up)
        return torch.nn.functional.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        silu = torch.nn.functional.silu(gate)
        grad_up = torch.mul(grad, silu) if ctx.needs_input_grad[1] else None
        grad_gate = None
        if ctx.needs_input_grad[0]:
            grad_gate = torch.ops.aten.silu_backward(torch.mul(grad, up), gate)
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) ⊙ up`` (same shapes and dtype), keeping only ``gate`` and ``up`` for backward; equal
    to ``F.silu(gate) * up`` in forward and backward."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    return _SwiGLU.apply(gate, up)
