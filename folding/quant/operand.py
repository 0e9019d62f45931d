"""FP8 operands as an FP8 GEMM keeps them for its backward: codes and scales, decoded when read.

An FP8 GEMM quantizes each operand along its contraction; the operands its backward reads again (the
input, for the weight gradient) can be kept in that quantized form, 1 byte per element plus the
recipe's scales, instead of the high-precision tensor (TransformerEngine keeps its GEMM inputs this
way). :func:`quantize_operand` quantizes a tensor exactly as :func:`folding.quant.quant_dequant` does
and returns the codes and scales as an :class:`Fp8Operand`; its :meth:`~Fp8Operand.dequantize` is
``quant_dequant``'s result bit for bit (``quant_dequant`` is that composition), so a backward that
reads the kept operand computes what one that re-quantizes the high-precision tensor computes.

What an operand of ``R × C`` elements keeps, quantized along ``C`` (its contraction ``dim``, moved last):

========== ====================================================== ==============================
recipe     codes                                                  scales
========== ====================================================== ==============================
delayed    e4m3 (e5m2 for gradients), ``R·C`` bytes               one float32 per tensor
tensorwise e4m3 (e5m2 for gradients), ``R·C`` bytes               one float32 per tensor
blockwise  e4m3, ``R·C`` bytes                                    float32 per 1×128 block (weights
                                                                  128×128): ``4·R·ceil(C/128)``
mxfp8      e4m3, ``R·C`` bytes                                    one E8M0 byte per 32: ``R·ceil(C/32)``
rowwise    e4m3, ``R·C`` bytes                                    one float32 per row: ``4·R``
========== ====================================================== ==============================

Usage::

    op = quantize_operand(x_MK, "mxfp8", "input", dim=0)   # x as the weight gradient reads it
    ctx.save_for_backward(*op.tensors); ctx.x_op = op.stripped()
    x_hat = ctx.x_op.with_tensors(*ctx.saved_tensors).dequantize()   # == quant_dequant(x_MK, "mxfp8", "input", 0)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from folding.quant.formats import dequantize
from folding.quant.fp8 import quantize_fp8_blockwise, quantize_fp8_rowwise, quantize_fp8_tensorwise
from folding.quant.mx import quantize_mxfp8

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8", "rowwise")
"""Recipes that :func:`quantize_operand` (and :mod:`folding.quant.emulate`) understand."""

ROLES = ("input", "weight", "grad")
"""Operand roles: activations, weights, output gradients."""

MX_BLOCK = 32
"""Elements per MXFP8 scale."""


def check_recipe(recipe: str) -> None:
    """Raise a clear error unless ``recipe`` is one of :data:`RECIPES`."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r} is not one of {RECIPES} (or None for no FP8)")


@dataclasses.dataclass(frozen=True)
class Fp8Operand:
    """A tensor kept as FP8 codes and scales (see the module docstring)."""

    data: Optional[torch.Tensor]
    """The FP8 codes, the quantized dimension last (``None`` in a :meth:`stripped` record)."""
    scale_inv: Optional[torch.Tensor]
    """Inverse scales: float32, or uint8 E8M0 bytes (MXFP8); ``None`` in a :meth:`stripped` record."""
    block: Optional[tuple]
    """Block of one scale over the codes' last two dimensions (``None``: per tensor or per row)."""
    dim: Optional[int]
    """The tensor's dimension the codes' last dimension holds (``None``: not moved)."""
    dtype: torch.dtype
    """The dtype :meth:`dequantize` returns (the quantized tensor's)."""

    def dequantize(self) -> torch.Tensor:
        """The decoded tensor in :attr:`dtype`, in the quantized tensor's shape."""
        out = dequantize(self.data, self.scale_inv, self.dtype, block=self.block)
        return out if self.dim is None else out.movedim(-1, self.dim)

    @property
    def tensors(self) -> tuple:
        """``(data, scale_inv)``, for ``ctx.save_for_backward``."""
        return self.data, self.scale_inv

    def stripped(self) -> "Fp8Operand":
        """This record without its tensors (what a context keeps beside its saved tensors)."""
        return dataclasses.replace(self, data=None, scale_inv=None)

    def with_tensors(self, data: torch.Tensor, scale_inv: torch.Tensor) -> "Fp8Operand":
        """This record with ``data`` and ``scale_inv`` (those of :attr:`tensors`, back from the context)."""
        return dataclasses.replace(self, data=data, scale_inv=scale_inv)

    @property
    def nbytes(self) -> int:
        """Bytes of the codes and the scales."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors if t is not None)


def quantize_operand(x: torch.Tensor, recipe: str, role: str = "input", dim: int = -1) -> Fp8Operand:
    """``x`` quantized as operand ``role`` of a GEMM contracting over ``dim`` (the formats and blocks of
    :mod:`folding.quant.emulate`'s table; ``weight`` under ``blockwise``: 128×128 blocks over the last two
    dimensions, ``dim`` unused). ``delayed`` without its state is current per-tensor scaling."""
    check_recipe(recipe)
    if role not in ROLES:
        raise ValueError(f"role={role!r} is not one of {ROLES}")
    if x.numel() == 0:
        return Fp8Operand(x.to(torch.float8_e4m3fn), torch.ones((), device=x.device), None, None, x.dtype)
    if recipe in ("delayed", "tensorwise"):
        fmt = torch.float8_e5m2 if role == "grad" else torch.float8_e4m3fn
        data, s_inv = quantize_fp8_tensorwise(x, fmt)
        return Fp8Operand(data, s_inv, None, None, x.dtype)
    if recipe == "blockwise" and role == "weight":
        data, s_inv = quantize_fp8_blockwise(x, (128, 128))
        return Fp8Operand(data, s_inv, (128, 128), None, x.dtype)
    xt = x.movedim(dim, -1)
    if recipe == "blockwise":
        data, s_inv = quantize_fp8_blockwise(xt, (1, 128))
        return Fp8Operand(data, s_inv, (1, 128), dim, x.dtype)
    if recipe == "rowwise":
        data, s_inv = quantize_fp8_rowwise(xt, torch.float8_e4m3fn, power_2_scale=True)
        return Fp8Operand(data, s_inv, None, dim, x.dtype)
    return _mxfp8_operand(xt, dim, x.dtype)


def _mxfp8_operand(xt: torch.Tensor, dim: int, dtype: torch.dtype) -> Fp8Operand:
    """MXFP8 (rceil) along the last dimension of ``xt``, zero-padded to whole blocks for quantization;
    the codes are kept without the padding (:func:`folding.quant.formats.dequantize` decodes partial
    blocks)."""
    k = xt.shape[-1]
    pad = (-k) % MX_BLOCK
    data, scales = quantize_mxfp8(torch.nn.functional.pad(xt, (0, pad)) if pad else xt, MX_BLOCK, "rceil")
    if pad:
        data = data[..., :k].contiguous()
    return Fp8Operand(data, scales, (1, MX_BLOCK), dim, dtype)
