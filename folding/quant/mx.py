"""MXFP8 (OCP Microscaling v1.0): e4m3 elements sharing one E8M0 power-of-two scale per block.

Blocks are ``block_size`` (32) consecutive elements of the last dimension. For a block with
largest magnitude ``amax`` the shared exponent X is:

- ``scale_mode="floor"`` (OCP MX v1.0): ``X = floor(log2(amax)) - 8`` (8 = emax of e4m3). Scaled
  values lie in [256, 512) at the top of the block, so the largest ones saturate to ±448.
- ``scale_mode="rceil"`` (the rule NVIDIA's MXFP8 recipes use): ``X = ceil(log2(amax * (1/448)))``
  so that ``amax / 2^X <= 448`` and no value saturates. This is the rule to use on the wire.

X is clamped to [-127, 127]; an all-zero block gets byte 0 (2^-127). A block holding a NaN or an
Inf gets the NaN scale byte 255, so the whole block decodes to NaN (the MX rule for a NaN scale);
its finite elements are still encoded against the block's finite amax. Elements are
``cast_to_fp8(x / 2^X)``: round-to-nearest-even with saturation.

Usage::

    data, scales = quantize_mxfp8(x_MK)                 # float8_e4m3fn [M, K], uint8 [M, K/32]
    x_hat = dequantize(data, scales, torch.bfloat16, block=(1, 32))   # folding.quant.formats
"""

from __future__ import annotations

import torch

from folding.quant.formats import (
    E8M0_BIAS,
    E8M0_NAN,
    ceil_log2,
    dequantize,
    floor_log2,
    fp8_codes_,
)

SCALE_MODES = ("floor", "rceil")
"""Supported rules for the shared exponent (see the module docstring)."""

_E4M3_EMAX = 8
_E4M3_MAX = 448.0


def _check_blocks(x: torch.Tensor, block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size={block_size} must be positive (OCP MX uses 32)")
    if x.dim() == 0 or x.shape[-1] % block_size != 0:
        raise ValueError(
            f"MXFP8 needs the last dimension divisible by block_size={block_size}, got shape "
            f"{tuple(x.shape)}; pad the last dimension to a multiple of {block_size} first"
        )


def mx_shared_exponent(amax: torch.Tensor, scale_mode: str = "floor") -> torch.Tensor:
    """The E8M0 scale byte (uint8) of blocks whose finite amax is ``amax`` (float32, >= 0).

    Zero blocks give byte 0; NaN handling is left to the caller (:func:`quantize_mxfp8`).
    """
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode={scale_mode!r} is not one of {SCALE_MODES}")
    amax = amax.float()
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    if scale_mode == "floor":
        exp = floor_log2(safe) - _E4M3_EMAX
    else:
        # the constant as a float32 tensor built on amax's device (a host tensor would be a copy)
        ratio = safe * torch.full((), 1.0 / _E4M3_MAX, dtype=torch.float32, device=safe.device)
        ratio = torch.where(ratio > 0, ratio, torch.full_like(ratio, 2.0**-149))
        exp = ceil_log2(ratio)
    byte = (exp + E8M0_BIAS).clamp(0, 254)
    byte = torch.where(amax > 0, byte, torch.zeros_like(byte))
    return byte.to(torch.uint8)


def quantize_mxfp8(
    x: torch.Tensor, block_size: int = 32, scale_mode: str = "floor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to MXFP8 over its last dimension.

    Returns ``(data, scales)``: ``data`` is ``torch.float8_e4m3fn`` with the shape of ``x``;
    ``scales`` is uint8 E8M0 bytes of shape ``x.shape[:-1] + (K // block_size,)``.
    The last dimension must be divisible by ``block_size``.
    """
    _check_blocks(x, block_size)
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode={scale_mode!r} is not one of {SCALE_MODES}")
    lead, k = x.shape[:-1], x.shape[-1]
    blocks = (*lead, k // block_size, block_size)
    # the one float32 temporary: |x| in place for the amax, then refilled with x and scaled in place
    t = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True).reshape(blocks)
    bad = ~torch.isfinite(t.abs_().amax(-1))  # a NaN or an Inf in the block
    amax = t.nan_to_num_(0.0, 0.0, 0.0).amax(-1)  # the amax of the block's finite elements
    byte = mx_shared_exponent(amax, scale_mode)
    scale = torch.exp2((byte.to(torch.int32) - E8M0_BIAS).float()).unsqueeze(-1)
    data = fp8_codes_(t.copy_(x.reshape(blocks)).div_(scale), torch.float8_e4m3fn).reshape(x.shape)
    byte = torch.where(bad, torch.full_like(byte, E8M0_NAN), byte)
    return data, byte


def fake_quant_mxfp8(x: torch.Tensor, dim: int = -1, block_size: int = 32, scale_mode: str = "rceil") -> torch.Tensor:
    """Quantize→dequantize ``x`` in MXFP8 with blocks along ``dim`` (zero-padded to a whole block).

    No gradient logic here; :func:`folding.quant.fake_quant` adds the straight-through gradient.
    """
    xt = x.movedim(dim, -1)
    k = xt.shape[-1]
    pad = (-k) % block_size
    if pad:
        xt = torch.nn.functional.pad(xt, (0, pad))
    data, scales = quantize_mxfp8(xt, block_size, scale_mode)
    out = dequantize(data, scales, x.dtype, block=(1, block_size))[..., :k]
    return out.movedim(-1, dim)
