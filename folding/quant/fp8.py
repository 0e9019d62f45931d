"""FP8 with float32 amax scaling: per tensor, per row, and 1×128 / 128×128 blocks.

The scale of a group of values (a tensor, a row, a block) maps its amax onto the format's max:
``scale = fp8_max / amax`` and ``data = cast_to_fp8(x * scale)``; dequantization
(:func:`folding.quant.formats.dequantize`, the one decode of every format) multiplies by
``scale_inv = 1 / scale``. A group whose amax is 0 gets scale 1 (zeros stay exactly zero); a group
holding a NaN or an Inf dequantizes to NaN. With ``power_2_scale=True`` the scale is rounded down
to a power of two (so that ``x * scale`` is exact and nothing saturates), as the Hopper blockwise
recipe does.

- per tensor: ``quantize_fp8_tensorwise`` (the ``delayed`` / ``tensorwise`` recipes).
- per row: ``quantize_fp8_rowwise`` (one scale per row of the last dimension; the dispatcher wire
  format and ``torch._scaled_grouped_mm``'s rowwise scaling); ``quantize_fp8_group_columns`` (one
  scale per column of each group of rows: the per-expert token-wise scaling of a weight gradient).
- blocks: ``quantize_fp8_blockwise`` with ``block=(1, 128)`` (activations, gradients) or
  ``(128, 128)`` (weights) over the last two dimensions, the shape not necessarily divisible.

Usage::

    data, scale_inv = quantize_fp8_rowwise(x)            # scale_inv: float32 x.shape[:-1] + (1,)
    x_hat = dequantize(data, scale_inv)                   # = data.float() * scale_inv
    data, s_inv = quantize_fp8_blockwise(w_NK, block=(128, 128))
    w_hat = dequantize(data, s_inv, block=(128, 128))
"""

from __future__ import annotations

import torch

from folding.quant.formats import blocked, floor_log2, fp8_codes_, fp8_max


def _scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, power_2_scale: bool) -> torch.Tensor:
    """float32 scale = fp8_max / amax (1 where amax == 0; NaN where amax is not finite)."""
    amax = amax.float()
    # a true float32 division (``float / tensor`` would multiply by a rounded reciprocal)
    scale = torch.full_like(amax, fp8_max(dtype)) / torch.where(amax > 0, amax, torch.ones_like(amax))
    scale = scale.clamp(max=2.0**127)  # a subnormal amax must not give an infinite scale
    if power_2_scale:  # exact floor(log2): ``torch.log2`` rounds 2^k·(1 - 2^-24) up to k
        scale = torch.exp2(floor_log2(scale).float())
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def _working_copy(x: torch.Tensor) -> torch.Tensor:
    """The one float32 temporary of a quantization: ``x`` copied to float32 (never an alias of ``x``).
    The amax is taken from it in place (``abs_``), then it is refilled from ``x``, scaled in place and
    cast (:func:`~folding.quant.formats.fp8_codes_`): bitwise the out-of-place formulas, one
    allocation of the input's size instead of one per step."""
    return x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)


def quantize_fp8_tensorwise(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, power_2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """One float32 scale for the whole tensor. Returns ``(data, scale_inv)``, ``scale_inv`` a 0-dim tensor."""
    t = _working_copy(x)
    amax = t.abs_().amax() if x.numel() else torch.zeros((), device=x.device)
    scale = _scale_from_amax(amax, dtype, power_2_scale)
    return fp8_codes_(t.copy_(x).mul_(scale), dtype), 1.0 / scale


def quantize_fp8_rowwise(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, power_2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """One float32 scale per row (over the last dimension).

    Returns ``(data, scale_inv)`` with ``data`` of ``x``'s shape and ``scale_inv`` float32 of shape
    ``x.shape[:-1] + (1,)``. Zero rows are safe (scale 1). One float32 temporary of ``x``'s size.
    """
    if x.dim() == 0:
        raise ValueError("quantize_fp8_rowwise needs at least 1 dimension; got a 0-dim tensor")
    t = _working_copy(x)
    if x.shape[-1] == 0:
        amax = torch.zeros(x.shape[:-1] + (1,), device=x.device)
    else:
        amax = t.abs_().amax(-1, keepdim=True)
    scale = _scale_from_amax(amax, dtype, power_2_scale)
    return fp8_codes_(t.copy_(x).mul_(scale), dtype), 1.0 / scale


def quantize_fp8_group_columns(
    x_NC: torch.Tensor,
    counts_G: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    power_2_scale: bool = False,
    host_counts=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One float32 scale per column of each group of consecutive rows (``counts_G`` rows each).

    The groups are the experts of a weight-gradient GEMM, whose contraction runs over tokens: each
    group's columns are scaled like :func:`quantize_fp8_rowwise` of that group's transpose, bit for
    bit. ``counts_G``: an integer tensor on ``x_NC``'s device summing to N (not checked: no host
    sync). ``host_counts``: the same counts as Python ints when the caller holds them (the ``torch``
    FP8 experts do): each group's rows are then scaled in place, one float32 temporary of ``x``'s
    size in all; without them the per-row scales are gathered on the device (a second one).
    Returns ``(data_NC, scale_inv_GC)``; an empty group gets scale 1.
    """
    if x_NC.dim() != 2 or counts_G.dim() != 1:
        raise ValueError(
            f"quantize_fp8_group_columns needs x [N, C] and counts [G]; got {tuple(x_NC.shape)} and "
            f"{tuple(counts_G.shape)}"
        )
    n, g = x_NC.shape[0], counts_G.shape[0]
    t = _working_copy(x_NC)
    amax_GC = torch.segment_reduce(t.abs_(), "max", lengths=counts_G, axis=0, unsafe=True, initial=0.0)
    scale_GC = _scale_from_amax(amax_GC, dtype, power_2_scale)
    t.copy_(x_NC)
    if host_counts is not None:
        for t_gC, s_C in zip(t.split(list(host_counts)), scale_GC):
            t_gC.mul_(s_C)
    else:
        group_N = torch.repeat_interleave(torch.arange(g, device=x_NC.device), counts_G, output_size=n)
        t.mul_(scale_GC[group_N])
    return fp8_codes_(t, dtype), 1.0 / scale_GC


def quantize_fp8_blockwise(
    x: torch.Tensor,
    block: tuple[int, int] = (1, 128),
    dtype: torch.dtype = torch.float8_e4m3fn,
    power_2_scale: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One float32 scale per ``block`` of the last two dimensions (1-D inputs are one row).

    Returns ``(data, scale_inv)``: ``data`` has ``x``'s shape; ``scale_inv`` has shape
    ``x.shape[:-2] + (ceil(M/bm), ceil(K/bk))``. Partial edge blocks are allowed.
    """
    if len(block) != 2 or min(block) <= 0:
        raise ValueError(f"block={block} must be two positive sizes such as (1, 128) or (128, 128)")
    x2 = x.unsqueeze(0) if x.dim() == 1 else x
    xb, (m, k) = blocked(x2, block)
    amax = xb.abs().amax(dim=(-3, -1), keepdim=True)
    scale = _scale_from_amax(amax, dtype, power_2_scale)
    data = fp8_codes_(xb * scale, dtype)  # the product is a fresh float32 tensor: saturated in place
    data = data.reshape(*xb.shape[:-4], xb.shape[-4] * block[0], xb.shape[-2] * block[1])[..., :m, :k]
    scale_inv = (1.0 / scale).squeeze(-1).squeeze(-2)
    if x.dim() == 1:
        data, scale_inv = data.squeeze(0), scale_inv.squeeze(0)
    return data.contiguous(), scale_inv
