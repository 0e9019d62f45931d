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

from folding.quant.formats import dequantize
from folding.quant.fp8 import (
    quantize_fp8_blockwise,
    quantize_fp8_rowwise,
    quantize_fp8_tensorwise,
)
from folding.quant.mx import fake_quant_mxfp8

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8", "rowwise")
"""Recipes that :func:`fake_quant` and :func:`emulated_linear` understand."""

ROLES = ("input", "weight", "grad")
"""Operand roles: activations, weights, output gradients."""


def check_recipe(recipe: str) -> None:
    """Raise a clear error unless ``recipe`` is one of :data:`RECIPES`."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r} is not one of {RECIPES} (or None for no FP8)")


def quant_dequant(x: torch.Tensor, recipe: str, role: str = "input", dim: int = -1) -> torch.Tensor:
    """Quantize→dequantize ``x`` as operand ``role`` of a GEMM contracting over ``dim`` (no autograd logic).

    ``weight`` under ``blockwise`` uses 128×128 blocks over the last two dimensions (``dim`` unused).
    """
    check_recipe(recipe)
    if role not in ROLES:
        raise ValueError(f"role={role!r} is not one of {ROLES}")
    if x.numel() == 0:
        return x
    if recipe in ("delayed", "tensorwise"):
        fmt = torch.float8_e5m2 if role == "grad" else torch.float8_e4m3fn
        data, s_inv = quantize_fp8_tensorwise(x, fmt)
        return dequantize(data, s_inv, x.dtype)
    if recipe == "blockwise":
        if role == "weight":
            data, s_inv = quantize_fp8_blockwise(x, (128, 128))
            return dequantize(data, s_inv, x.dtype, block=(128, 128))
        xt = x.movedim(dim, -1)
        data, s_inv = quantize_fp8_blockwise(xt, (1, 128))
        return dequantize(data, s_inv, x.dtype, block=(1, 128)).movedim(-1, dim)
    if recipe == "rowwise":
        data, s_inv = quantize_fp8_rowwise(x.movedim(dim, -1), torch.float8_e4m3fn, power_2_scale=True)
        return dequantize(data, s_inv, x.dtype).movedim(-1, dim)
    return fake_quant_mxfp8(x, dim=dim, block_size=32, scale_mode="rceil")


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
    """``q(t, role, dim)`` for one GEMM: delayed state when given (``delayed`` recipe), else current scaling."""
    if recipe == "delayed" and delayed is not None:

        def q(t, role, dim):
            fmt = torch.float8_e5m2 if role == "grad" else torch.float8_e4m3fn
            return delayed.quant_dequant(t, tuple(key) + (role,), fmt) if t.numel() else t

        return q
    return lambda t, role, dim: quant_dequant(t, recipe, role, dim)


class _EmulatedLinear(torch.autograd.Function):
    """``y = q(x)·q(w)ᵀ``; backward ``dx = q(dy)·q(w)``, ``dw = q(dy)ᵀ·q(x)`` with per-GEMM quantization.

    Per-tensor recipes quantize each operand once (the scale does not depend on the GEMM's
    direction), so the forward's quantized x and w are reused in backward; block recipes
    re-quantize x, w and dy along each GEMM's contraction.
    """

    @staticmethod
    def forward(ctx, x_MK, w_NK, recipe, delayed, key):
        q = _quantizer(recipe, delayed, key)
        ctx.q, ctx.per_tensor, ctx.recipe = q, recipe in ("delayed", "tensorwise"), recipe
        xq = q(x_MK, "input", -1)
        wq = q(w_NK, "weight", -1)
        ctx.save_for_backward(*((xq, wq) if ctx.per_tensor else (x_MK, w_NK)))
        return (xq.float() @ wq.float().t()).to(x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_NK = ctx.saved_tensors
        q = ctx.q
        dy_MN = dy_MN.contiguous()
        dx = dw = None
        if ctx.per_tensor:
            gq = q(dy_MN, "grad", -1).float()
            if ctx.needs_input_grad[0]:
                dx = (gq @ w_NK.float()).to(x_MK.dtype)
            if ctx.needs_input_grad[1]:
                dw = (gq.t() @ x_MK.float()).to(w_NK.dtype)
            return dx, dw, None, None, None
        if ctx.needs_input_grad[0]:
            dx = (q(dy_MN, "grad", -1).float() @ q(w_NK, "weight", 0).float()).to(x_MK.dtype)
        if ctx.needs_input_grad[1]:
            dw = (q(dy_MN, "grad", 0).float().t() @ q(x_MK, "input", 0).float()).to(w_NK.dtype)
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
