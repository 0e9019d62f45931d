"""Element formats shared by every low-precision recipe: FP8 (e4m3 / e5m2) casts and E8M0 scales.

Plain PyTorch, no kernels: everything here runs on CPU and GPU alike.

- :func:`cast_to_fp8` converts (already scaled) values to an FP8 dtype with saturation to ±max,
  round-to-nearest-even, NaN kept NaN. OCP e4m3 (``torch.float8_e4m3fn``) has no infinity, so an
  infinite input becomes NaN there; e5m2 keeps infinities.
- E8M0 scale bytes: ``byte = X + 127`` encodes 2^X for X in [-127, 127]; byte 255 is NaN.
- :func:`dequantize` is the one decode of every scaled format (per tensor, per row, per block,
  MXFP8): each code times the inverse scale of its group, in float32, cast to the wanted dtype.

Usage::

    data = cast_to_fp8(x_f32 * scale, torch.float8_e4m3fn)
    s = e8m0_to_float(scale_bytes)            # float32 powers of two (NaN for byte 255)
    x_hat = dequantize(data, scale_inv, torch.bfloat16)                 # per tensor / per row
    x_hat = dequantize(data, scale_bytes, block=(1, 32))                # MXFP8 (E8M0 scales)
"""

from __future__ import annotations

from typing import Optional

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The FP8 element dtypes supported."""

E8M0_BIAS = 127
"""Exponent bias of the E8M0 scale format."""
E8M0_NAN = 255
"""The E8M0 byte reserved for NaN."""


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite magnitude of an FP8 dtype (448 for e4m3, 57344 for e5m2)."""
    check_fp8_dtype(dtype)
    return float(torch.finfo(dtype).max)


def check_fp8_dtype(dtype: torch.dtype) -> None:
    """Raise a clear error unless ``dtype`` is one of :data:`FP8_DTYPES`."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype={dtype} is not an FP8 element format; use torch.float8_e4m3fn or torch.float8_e5m2")


def cast_to_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast ``x`` to ``dtype`` (FP8) saturating finite overflow to ±max, rounding to nearest even.

    NaN stays NaN; ±Inf becomes NaN for e4m3 (no infinity encoding) and stays ±Inf for e5m2. One
    float32 copy of ``x`` is made (:func:`fp8_codes_` works on it in place)."""
    check_fp8_dtype(dtype)
    return fp8_codes_(x.to(torch.float32, copy=True), dtype)


def fp8_codes_(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`cast_to_fp8` of a float32 tensor the caller owns, saturated in place (``t`` is
    overwritten): the quantizers scale into one float32 temporary and cast it here, so a quantization
    allocates no second float32 tensor of its input's size (the masks are booleans)."""
    check_fp8_dtype(dtype)
    m = fp8_max(dtype)
    inf = torch.isinf(t)
    t.clamp_(-m, m)  # NaN stays NaN; ±Inf becomes ±max here and is restored below
    if dtype == torch.float8_e4m3fn:
        t.masked_fill_(inf, float("nan"))
    else:
        t.masked_fill_(inf & (t > 0), float("inf")).masked_fill_(inf & (t < 0), float("-inf"))
    return t.to(dtype)


def e8m0_to_float(scale_bytes: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 scale bytes (uint8) to float32 powers of two; byte 255 decodes to NaN."""
    b = scale_bytes.to(torch.int32)
    val = torch.exp2((b - E8M0_BIAS).float())
    return torch.where(b == E8M0_NAN, torch.full_like(val, float("nan")), val)


def blocked(x: torch.Tensor, block: tuple[int, int]):
    """View ``x`` (``[..., M, K]`` in float32, zero-padded to whole blocks) as ``[..., Mb, bm, Kb, bk]``;
    returns the view and ``(M, K)``."""
    bm, bk = block
    m, k = x.shape[-2], x.shape[-1]
    pm, pk = (-m) % bm, (-k) % bk
    xp = torch.nn.functional.pad(x.float(), (0, pk, 0, pm)) if (pm or pk) else x.float()
    lead = xp.shape[:-2]
    return xp.reshape(*lead, (m + pm) // bm, bm, (k + pk) // bk, bk), (m, k)


def dequantize(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    *,
    block: Optional[tuple[int, int]] = None,
) -> torch.Tensor:
    """Decode scaled low-precision codes: ``data.float()`` times the inverse scale of each element's
    group, cast to ``dtype`` (the inverse of every quantizer of :mod:`folding.quant`).

    - ``block=None``: ``scale_inv`` broadcasts against ``data``: a 0-dim tensor (one scale per
      tensor) or ``data.shape[:-1] + (1,)`` (one per row).
    - ``block=(bm, bk)``: one scale per ``bm×bk`` block of the last two dimensions (partial edge
      blocks allowed; 1-D ``data`` is one row): ``scale_inv`` of shape
      ``data.shape[:-2] + (ceil(M/bm), ceil(K/bk))``. MXFP8 is ``block=(1, 32)``.

    ``scale_inv`` is float32, or uint8 E8M0 bytes (MXFP8: ``2^(byte-127)``, byte 255 makes its
    whole block NaN).
    """
    if scale_inv.dtype == torch.uint8:
        scale_inv = e8m0_to_float(scale_inv)
    if block is None:
        return (data.float() * scale_inv).to(dtype)
    if data.dim() == 0 or len(block) != 2 or min(block) <= 0:
        raise ValueError(f"block={block} dequantizes blocks of the last two dimensions of a tensor; got a 0-dim one")
    one_d = data.dim() == 1
    d2 = data.unsqueeze(0) if one_d else data
    s2 = scale_inv.unsqueeze(0) if one_d else scale_inv
    db, (m, k) = blocked(d2, block)
    want = tuple(db.shape[:-4]) + (db.shape[-4], db.shape[-2])
    if tuple(s2.shape) != want:
        raise ValueError(
            f"scales shape {tuple(scale_inv.shape)} does not match data shape {tuple(data.shape)} with "
            f"block={tuple(block)}; expected {want[1:] if one_d else want}"
        )
    out = db * s2.unsqueeze(-1).unsqueeze(-3)
    out = out.reshape(*db.shape[:-4], db.shape[-4] * block[0], db.shape[-2] * block[1])[..., :m, :k]
    out = out.squeeze(0) if one_d else out
    return out.to(dtype)


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2(x)) for positive finite float32 ``x`` (exact, via the binary exponent), as int32."""
    _, e = torch.frexp(x.float())
    return e - 1


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) for positive finite float32 ``x`` (exact), as int32."""
    m, e = torch.frexp(x.float())
    return torch.where(m == 0.5, e - 1, e)
