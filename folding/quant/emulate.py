"""CPU emulation of FP8 / MXFP8 GEMM numerics: fake quantization and an emulated linear.

Legend: a GEMM ``y_MN = x_MK · w_NKᵀ``; M rows (tokens), K contraction, N outputs.

A recipe names how a GPU GEMM quantizes its operands (TransformerEngine's recipes):

========== ===================== ====================== ===================================
recipe     activations / inputs  weights                output gradients
========== ===================== ====================== ===================================
delayed    e4m3, per tensor      e4m3, per tensor       e5m2, per tensor
tensorwise e4m3, per tensor      e4m3, per tensor       e5m2, per tensor
blockwise  e4m3, 1×128 blocks    e4m3, 128×128 blocks   e4m3, 1×128 blocks
mxfp8      e4m3, 1×32 blocks     e4m3, 1×32 blocks      e4m3, 1×32 blocks (E8M0, rceil)
rowwise    e4m3, per row         e4m3, per row          e4m3, per row
========== ===================== ====================== ===================================

1-D blocks run along the GEMM's contraction dimension, so an operand is quantized differently in
each GEMM it takes part in (rowwise for the forward, columnwise for the weight gradient), exactly
as the GPU kernels do. ``rowwise`` (the Hopper recipe of ``torch._scaled_grouped_mm``, which
TransformerEngine does not have) gives every row of an operand along the GEMM's contraction its own
power-of-two float32 scale: in the weight-gradient GEMM that is one scale per feature column of each
expert's tokens. ``delayed`` keeps amax histories in a
:class:`folding.quant.delayed.DelayedScaling` passed by the caller (without one it falls back to the
current amax); per-tensor scales are float32, blockwise scales powers of two.

- :func:`fake_quant` ``(x, recipe)``: quantize→dequantize with a straight-through gradient.
- :func:`emulated_linear` ``(x_MK, w_NK, recipe)``: ``x·wᵀ`` whose forward GEMM and both backward
  GEMMs (``dx = dy·w``, ``dw = dyᵀ·x``) see their operands quantized as on the GPU, accumulating
  in float32.

Usage::

    y = emulated_linear(x_MK, w_NK, "mxfp8")
    x_q = fake_quant(x, "blockwise")
"""

from __future__ import annotations

import torch

from folding.quant.delayed import cast_with_scale
from folding.quant.operand import RECIPES, ROLES, Fp8Operand, check_recipe, quantize_operand

__all__ = ["RECIPES", "ROLES", "check_recipe", "emulated_linear", "fake_quant", "quant_dequant"]


def quant_dequant(x: torch.Tensor, recipe: str, role: str = "input", dim: int = -1) -> torch.Tensor:
    """Quantize→dequantize ``x`` as operand ``role`` of a GEMM contracting over ``dim`` (no autograd logic).

    ``weight`` under ``blockwise`` uses 128×128 blocks over the last two dimensions (``dim`` unused).
    The decode of :func:`folding.quant.operand.quantize_operand`'s codes and scales.
    """
    op = quantize_operand(x, recipe, role, dim)
    return x if x.numel() == 0 else op.dequantize()


class _FakeQuant(torch.autograd.Function):
    """Forward: quantize→dequantize. Backward: the gradient passes through unchanged (STE)."""

    @staticmethod
    def forward(ctx, x, recipe, role, dim):
        return quant_dequant(x, recipe, role, dim)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def fake_quant(x: torch.Tensor, recipe: str, role: str = "input", dim: int = -1) -> torch.Tensor:
    """Quantize→dequantize ``x`` per ``recipe`` with a straight-through gradient.

    ``recipe`` is one of :data:`RECIPES`; ``role`` (input,
    weight, grad) picks the format and block shape of the table above; 1-D blocks run along ``dim``.
    """
    check_recipe(recipe)
    return _FakeQuant.apply(x, recipe, role, dim)


def _quantizer(recipe: str, delayed, key):
    """``q(t, role, dim) -> Fp8Operand`` for one GEMM: delayed state when given (``delayed`` recipe), else
    current scaling."""
    if recipe == "delayed" and delayed is not None:

        def q(t, role, dim):
            if not t.numel():
                return quantize_operand(t, recipe, role, dim)
            fmt = torch.float8_e5m2 if role == "grad" else torch.float8_e4m3fn
            data, s_inv = delayed.quantize(t, tuple(key) + (role,), fmt)
            return Fp8Operand(data, s_inv, None, None, t.dtype)

        return q
    return lambda t, role, dim: quantize_operand(t, recipe, role, dim)


def _keep(ctx, name: str, op) -> tuple:
    """Record ``op``'s layout on ``ctx`` under ``name`` and return its tensors to save (``(None, None)``
    when nothing is kept)."""
    setattr(ctx, name, None if op is None else op.stripped())
    return (None, None) if op is None else op.tensors


def _weight_again(w_NK: torch.Tensor, recipe: str, scale) -> Fp8Operand:
    """A per-tensor recipe's forward codes of ``w``, made again: with the forward's delayed ``scale`` when
    there is one (:func:`folding.quant.delayed.cast_with_scale`), else by current scaling (stateless)."""
    if scale is None:
        return quantize_operand(w_NK, recipe, "weight", -1)
    return Fp8Operand(*cast_with_scale(w_NK, scale, torch.float8_e4m3fn), None, None, w_NK.dtype)


class _EmulatedLinear(torch.autograd.Function):
    """``y = q(x)·q(w)ᵀ``; backward ``dx = q(dy)·q(w)``, ``dw = q(dy)ᵀ·q(x)`` with per-GEMM quantization.

    What it keeps of ``x`` is FP8, as TransformerEngine keeps its GEMM inputs: ``x`` only as the weight
    gradient reads it, codes and scales (:class:`folding.quant.operand.Fp8Operand`), made in the forward
    (block recipes: quantized along the tokens, TE's columnwise copy), and nothing when the weight needs no
    gradient. It keeps ``w`` itself (a view of the parameter), not a copy: per-tensor recipes make the
    forward's codes of ``w`` again in backward (with the forward's scale under ``delayed``), block recipes
    re-quantize it along the input gradient's contraction. Decoding a kept operand gives the bits
    re-quantizing the high-precision tensor gives, so the gradients are those of keeping ``x`` and ``w``.
    """

    @staticmethod
    def forward(ctx, x_MK, w_NK, recipe, delayed, key):
        q = _quantizer(recipe, delayed, key)
        ctx.q, ctx.recipe, ctx.dtypes = q, recipe, (x_MK.dtype, w_NK.dtype)
        ctx.per_tensor = recipe in ("delayed", "tensorwise")
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        stateful = recipe == "delayed" and delayed is not None
        w_scale = delayed.scale_of(tuple(key) + ("weight",), w_NK.device) if stateful and need_dx else None
        xq = q(x_MK, "input", -1)
        wq = q(w_NK, "weight", -1)
        # the weight gradient reads x along the tokens: per-tensor codes do not depend on the direction
        x_keep = (xq if ctx.per_tensor else q(x_MK, "input", 0)) if need_dw else None
        ctx.save_for_backward(*_keep(ctx, "x_op", x_keep), w_NK if need_dx else None, w_scale)
        return (xq.dequantize().float() @ wq.dequantize().float().t()).to(x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        x_data, x_scale, w_NK, w_scale = ctx.saved_tensors
        q, (x_dtype, w_dtype) = ctx.q, ctx.dtypes
        dy_MN = dy_MN.contiguous()
        dx = dw = None
        if ctx.per_tensor:
            gq = gq_t = q(dy_MN, "grad", -1).dequantize().float()
            wq = _weight_again(w_NK, ctx.recipe, w_scale) if ctx.needs_input_grad[0] else None
        else:
            gq = q(dy_MN, "grad", -1).dequantize().float() if ctx.needs_input_grad[0] else None
            gq_t = q(dy_MN, "grad", 0).dequantize().float() if ctx.needs_input_grad[1] else None
            wq = q(w_NK, "weight", 0) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[0]:
            dx = (gq @ wq.dequantize().float()).to(x_dtype)
        if ctx.needs_input_grad[1]:
            dw = (gq_t.t() @ ctx.x_op.with_tensors(x_data, x_scale).dequantize().float()).to(w_dtype)
        return dx, dw, None, None, None


def emulated_linear(x_MK: torch.Tensor, w_NK: torch.Tensor, recipe: str, delayed=None, key: tuple = ()) -> torch.Tensor:
    """``x_MK · w_NKᵀ`` with the FP8/MXFP8 numerics of ``recipe`` in forward and backward (see module doc).

    For ``recipe="delayed"``, pass a :class:`folding.quant.delayed.DelayedScaling` as ``delayed``
    and a ``key`` naming this GEMM to use amax histories; without it the current amax is used.
    """
    check_recipe(recipe)
    if x_MK.dim() != 2 or w_NK.dim() != 2 or x_MK.shape[1] != w_NK.shape[1]:
        raise ValueError(
            f"emulated_linear needs x [M, K] and w [N, K]; got {tuple(x_MK.shape)} and {tuple(w_NK.shape)}"
        )
    return _EmulatedLinear.apply(x_MK, w_NK, recipe, delayed, key)
