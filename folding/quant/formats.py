"""Element formats shared by every low-precision recipe: FP8 (e4m3 / e5m2) casts and E8M0 scales.

Plain PyTorch, no kernels: everything here runs on CPU and GPU alike.

- :func:`cast_to_fp8` converts (already scaled) values to an FP8 dtype with saturation to ±max,
  round-to-nearest-even, NaN kept NaN. OCP e4m3 (``torch.float8_e4m3fn``) has no infinity, so an
  infinite input becomes NaN there; e5m2 keeps infinities.
- E8M0 scale bytes: ``byte = X + 127`` encodes 2^X for X in [-127, 127]; byte 255 is NaN.

Usage::

    data = cast_to_fp8(x_f32 * scale, torch.float8_e4m3fn)
    s = e8m0_to_float(scale_bytes)            # float32 powers of two (NaN for byte 255)
"""

from __future__ import annotations

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

    NaN stays NaN; ±Inf becomes NaN for e4m3 (no infinity encoding) and stays ±Inf for e5m2.
    """
    check_fp8_dtype(dtype)
    xf = x.float()
    m = fp8_max(dtype)
    out = xf.clamp(-m, m)
    if dtype == torch.float8_e4m3fn:
        out = torch.where(torch.isinf(xf), torch.full_like(xf, float("nan")), out)
    else:
        out = torch.where(torch.isinf(xf), xf, out)
    return out.to(dtype)


def e8m0_to_float(scale_bytes: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 scale bytes (uint8) to float32 powers of two; byte 255 decodes to NaN."""
    b = scale_bytes.to(torch.int32)
    val = torch.exp2((b - E8M0_BIAS).float())
    return torch.where(b == E8M0_NAN, torch.full_like(val, float("nan")), val)


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2(x)) for positive finite float32 ``x`` (exact, via the binary exponent), as int32."""
    _, e = torch.frexp(x.float())
    return e - 1


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) for positive finite float32 ``x`` (exact), as int32."""
    m, e = torch.frexp(x.float())
    return torch.where(m == 0.5, e - 1, e)
