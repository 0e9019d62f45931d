"""A CPU stand-in for ``torch._scaled_grouped_mm`` that keeps the CUDA operator's rules.

The kernel runs only on CUDA (compute capability 9.0 rowwise, 10.0 MXFP8). The stand-in takes the
operator's arguments exactly (``tests/unit/test_experts_torch_fp8.py`` checks its signature against
the installed torch's schema, ``aten::_scaled_grouped_mm``, and binds every call the engine makes to
it), and it first runs torch's own checks of the operator: ``torch.ops.aten._scaled_grouped_mm`` on
``meta`` copies of the operands (same shapes, strides and dtypes), whose meta kernel (registered on
CPU builds too, ``torch/_meta_registrations.py``; torch 2.13 CPU has it) repeats the checks of the
CUDA operator: E4M3 operands, row-major ``mat_a`` and column-major ``mat_b``, strides multiples of 16
bytes, float32 or E8M0 scales that are contiguous and of the documented shapes (MXFP8: the blocked
layout's size for a 3-D operand, 2-D scales for a 2-D one), int32 1-D offsets, no bias, bf16 output.
The stand-in adds dimensions multiple of 16 and the group alignment the kernels need (16 rows, 32
for MXFP8) and, in the 2-D × 2-D (weight-gradient) call, no group of zero rows (the CUTLASS kernel
asserts "CUTLASS cannot handle delta=0" in some torch builds), then computes the reference numerics:
dequantize, fp32 matmul per group, cast. MXFP8
scales are decoded from the blocked layout with the tile formula of cuBLAS's documentation, written
independently of the engine's permute. Rows the operator leaves undefined (past the last group) come
back NaN.

Usage (``tests/unit/test_experts_torch_fp8.py``)::

    monkeypatch.setattr(torch, "_scaled_grouped_mm", recording_stand_in)
"""

import inspect

import torch

SCHEMA = torch._C._jit_get_schemas_for_operator("aten::_scaled_grouped_mm")[0]
"""The installed torch's schema of the operator."""
E8M0 = torch.float8_e8m0fnu
CALLS: list = []
"""One record per call of :func:`recording_stand_in`: operand shapes, fast accumulation, MXFP8."""


def up(x, m):
    """``x`` rounded up to a multiple of ``m``."""
    return -(-x // m) * m


def blocked_offsets(rows, cols):
    """Where cuBLAS's blocked layout keeps the scale of (r, c): 128×4 tiles of 512 bytes, row tiles
    outer; inside a tile at byte (r % 32)·16 + (r // 32)·4 + c."""
    r = torch.arange(rows).view(-1, 1)
    c = torch.arange(cols).view(1, -1)
    tile = (r // 128) * (up(cols, 4) // 4) + c // 4
    return tile * 512 + (r % 128 % 32) * 16 + (r % 128 // 32) * 4 + c % 4


def unblock(flat_u8, rows, cols):
    """``[rows, cols]`` scales from the blocked layout."""
    return flat_u8.reshape(-1)[blocked_offsets(rows, cols)]


def mx_dequant(data_RK, scales_RB):
    """MXFP8 operand ``[R, K]`` with its ``[R, K/32]`` E8M0 bytes, as float32."""
    s = torch.exp2(scales_RB.to(torch.int32).float() - 127).repeat_interleave(32, dim=1)
    return data_RK.float() * s


def meta_copy(t):
    """A ``meta`` tensor with ``t``'s shape, strides and dtype (None stays None)."""
    return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def scaled_grouped_mm(
    self, mat2, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False
):
    """CPU stand-in for ``torch._scaled_grouped_mm`` (2-D × 3-D and 2-D × 2-D with offsets): torch's
    meta kernel on ``meta`` copies of the operands (the CUDA operator's checks), then the stand-in's
    own checks, then the reference numerics."""
    operands = [meta_copy(t) for t in (self, mat2, scale_a, scale_b, offs, bias, scale_result)]
    torch.ops.aten._scaled_grouped_mm(*operands, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    a, b = self, mat2
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    sizes = [e - s for s, e in zip(starts, ends)]
    CALLS.append(dict(a=tuple(a.shape), b=tuple(b.shape), fast=use_fast_accum, mx=scale_a.dtype == E8M0, groups=sizes))
    assert a.dtype == b.dtype == torch.float8_e4m3fn, (a.dtype, b.dtype)
    assert a.dim() == 2 and b.dim() in (2, 3), "the engine uses 2-D x 3-D and 2-D x 2-D"
    assert a.stride(-1) == 1 and a.stride(-2) >= a.shape[-1], "Expected mat1 to not be transposed"
    assert b.stride(-2) == 1 and b.stride(-1) >= b.shape[-2], "Expected mat2 to be transposed"
    assert a.shape[-1] % 16 == 0 and b.shape[-2] % 16 == 0 and b.shape[-1] % 16 == 0, (a.shape, b.shape)
    assert bias is None and scale_result is None
    assert offs is not None and offs.dim() == 1 and offs.dtype == torch.int32
    assert out_dtype in (None, torch.bfloat16), "only bf16 output"
    mx = scale_a.dtype == E8M0
    assert (scale_a.dtype, scale_b.dtype) in ((torch.float32, torch.float32), (E8M0, E8M0))
    align = 32 if mx else 16  # the per-group row alignment the kernels need (what torchao pads to)
    assert all(e >= s and (e - s) % align == 0 for s, e in zip(starts, ends)), ends
    out_dtype = out_dtype or torch.bfloat16
    if b.dim() == 3:  # groups along a's rows; b[g] is [K, N]
        g_n, k, n = b.shape
        assert len(ends) == g_n and ends[-1] <= a.shape[0] and a.shape[1] == k
        out = torch.full((a.shape[0], n), float("nan"))  # rows past the last group: undefined
        if mx:
            assert scale_a.dim() == 2 and scale_b.shape == (g_n, up(n, 128) * up(k // 32, 4))
        else:
            assert scale_a.shape == (a.shape[0],) and scale_a.is_contiguous()
            assert scale_b.shape == (g_n, n) and scale_b.stride(1) == 1
        at = 0
        for g, (s, e) in enumerate(zip(starts, ends)):
            if mx:
                size = up(e - s, 128) * up(k // 32, 4)
                sa = unblock(scale_a.view(torch.uint8).reshape(-1)[at : at + size], e - s, k // 32)
                at += size if e > s else 0
                ag = mx_dequant(a[s:e], sa)
                bg = mx_dequant(b[g].t(), unblock(scale_b[g].view(torch.uint8), n, k // 32)).t()
            else:
                ag = a[s:e].float() * scale_a[s:e, None]
                bg = b[g].float() * scale_b[g][None, :]
            out[s:e] = ag @ bg
        return out.to(out_dtype)
    m, n = a.shape[0], b.shape[1]  # 2-D x 2-D: groups along the contraction
    assert ends[-1] == a.shape[1] == b.shape[0]
    # the CUTLASS kernel of this call asserts on a group without rows in some torch builds (a device
    # assert, which leaves the CUDA context unusable): the stand-in refuses it the same way
    assert all(e > s for s, e in zip(starts, ends)), f"CUTLASS cannot handle delta=0 (group ends {ends})"
    out = torch.empty((len(ends), m, n))
    if not mx:
        assert scale_a.shape == (len(ends) * m,) and scale_b.shape == (len(ends) * n,)
    at_a = at_b = 0
    for g, (s, e) in enumerate(zip(starts, ends)):
        if mx:
            kb = (e - s) // 32
            size_a, size_b = up(m, 128) * up(kb, 4), up(n, 128) * up(kb, 4)
            sa = unblock(scale_a.view(torch.uint8).reshape(-1)[at_a : at_a + size_a], m, kb)
            sb = unblock(scale_b.view(torch.uint8).reshape(-1)[at_b : at_b + size_b], n, kb)
            at_a, at_b = at_a + size_a, at_b + size_b
            ag, bg = mx_dequant(a[:, s:e], sa), mx_dequant(b[s:e].t(), sb).t()
        else:
            ag = a[:, s:e].float() * scale_a[g * m : (g + 1) * m, None]
            bg = b[s:e].float() * scale_b[g * n : (g + 1) * n][None, :]
        out[g] = ag @ bg
    return out.to(out_dtype)


def schema_params():
    """``(name, default)`` of every argument of the installed schema (``inspect.Parameter.empty``: none)."""
    return [(x.name, x.default_value if x.has_default_value() else inspect.Parameter.empty) for x in SCHEMA.arguments]


def signature_params(fn):
    """``(name, default)`` of every parameter of ``fn``, comparable with :func:`schema_params`."""
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def bind_to_schema(args, kwargs):
    """Bind a call to the operator's schema: at most as many positionals as it has arguments, keywords
    among its names and not given twice, every argument without a default given."""
    names = [x.name for x in SCHEMA.arguments]
    assert len(args) <= len(names), "too many positional arguments"
    bound = dict(zip(names, args))
    for k in kwargs:
        assert k in names and k not in bound, f"keyword {k!r} unknown to aten::_scaled_grouped_mm or repeated"
    bound.update(kwargs)
    missing = [x.name for x in SCHEMA.arguments if not x.has_default_value() and x.name not in bound]
    assert not missing, missing
    return bound


def recording_stand_in(*args, **kwargs):
    """What the tests install as ``torch._scaled_grouped_mm``: the call bound to the schema, then
    :func:`scaled_grouped_mm`."""
    bind_to_schema(args, kwargs)
    return scaled_grouped_mm(*args, **kwargs)
