"""Low-precision formats as plain PyTorch: MXFP8, FP8 (per tensor, per row, blockwise), emulation.

These are the numerics of the GPU recipes, runnable and checkable on any device; the experts use
them to emulate FP8 GEMMs on CPU and the token dispatcher uses them as wire formats.

Usage::

    from folding.quant import quantize_mxfp8, dequantize, fake_quant
    data, scales = quantize_mxfp8(x, scale_mode="rceil")
    x_hat = dequantize(data, scales, torch.bfloat16, block=(1, 32))   # the one decode of every format
    op = quantize_operand(x, "mxfp8", "input", dim=0)   # codes and scales an FP8 GEMM keeps for backward

See docs/precision.md for the formats, the recipes and the measured errors.
"""

from folding.quant.delayed import DelayedScaling
from folding.quant.emulate import RECIPES, emulated_linear, fake_quant, quant_dequant
from folding.quant.formats import cast_to_fp8, dequantize, e8m0_to_float, fp8_max
from folding.quant.fp8 import (
    quantize_fp8_blockwise,
    quantize_fp8_rowwise,
    quantize_fp8_tensorwise,
)
from folding.quant.mx import SCALE_MODES, quantize_mxfp8
from folding.quant.operand import Fp8Operand, quantize_operand

__all__ = [
    "DelayedScaling",
    "Fp8Operand",
    "RECIPES",
    "SCALE_MODES",
    "cast_to_fp8",
    "dequantize",
    "e8m0_to_float",
    "emulated_linear",
    "fake_quant",
    "fp8_max",
    "quant_dequant",
    "quantize_fp8_blockwise",
    "quantize_fp8_rowwise",
    "quantize_fp8_tensorwise",
    "quantize_mxfp8",
    "quantize_operand",
]
