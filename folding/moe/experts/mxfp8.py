"""MXFP8 expert GEMMs on the ``torch`` backend (compute capability 10.x): operands and swizzled scales.

Shape suffixes (docs/shapes.md): N rows sorted expert-major (each expert's rows padded to 32), L local
experts, I input features, O output features.

MXFP8: e4m3 elements with one E8M0 power-of-two scale per 32 consecutive elements along the GEMM's
contraction (the ``rceil`` rule of :mod:`folding.quant.mx`, NVIDIA's, as the ``emulated`` backend
uses), passed to ``torch._scaled_grouped_mm`` as ``torch.float8_e8m0fnu`` in the *blocked* layout
that cuBLAS and fbgemm read: a scale matrix ``[R, C]`` (R operand rows, C = K/32 blocks) is
zero-padded to multiples of 128 × 4 and cut into 128×4 tiles stored one after another (row tiles
outer); inside a tile the scale of (r, c) sits at byte ``(r % 32)·16 + (r // 32)·4 + c``
(:func:`to_blocked`).

Grouped layouts, as PyTorch's tests of the MXFP8 grouped GEMM build them (``test_matmul_cuda.py``):

- 2-D × 3-D (forward, input gradient): ``mat_a``'s scales group by group, each group's rows blocked
  on their own (padded to 128 rows in the layout), flattened and concatenated, viewed as
  ``[-1, ceil4(K/32)]``; ``mat_b = [L, K, N]`` column-major with ``[L, blocked]`` scales, each
  expert's ``[N, K/32]`` blocked.
- 2-D × 2-D (weight gradient, groups along the contraction: tokens): each group's ``[rows, Ne/32]``
  scales blocked on their own, concatenated, viewed as ``[ceil128(rows), -1]``.

Rows per expert are aligned to 32 so that no block straddles two experts. The kernel is fbgemm's
(a PyTorch build with ``USE_FBGEMM_GENAI``). Not run on a GPU yet; the CPU tests check these
layouts through a stand-in that decodes them with the tile formula above.

Usage (through :func:`folding.moe.experts.scaled.scaled_grouped_linear`)::

    y_NO = scaled_grouped_linear(x_NI, w_LOI, counts, "mxfp8")
"""

from __future__ import annotations

import torch

from folding.quant.mx import quantize_mxfp8

MX_BLOCK = 32
"""Elements per MXFP8 scale."""

E8M0 = torch.float8_e8m0fnu


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """The blocked (swizzled) layout of a ``[R, C]`` uint8 scale matrix, flat: ``ceil128(R)·ceil4(C)``
    bytes, zero where padded (see the module docstring)."""
    r, c = scales.shape
    rp, cp = _round_up(r, 128), _round_up(c, 4)
    if (rp, cp) != (r, c):
        scales = torch.nn.functional.pad(scales, (0, cp - c, 0, rp - r))
    tiles = scales.reshape(rp // 128, 128, cp // 4, 4).permute(0, 2, 1, 3)  # [row tile, col tile, 128, 4]
    # row r of a tile is 32·q + p: store (p, q, c) so that the byte is p·16 + q·4 + c
    return tiles.reshape(rp // 128, cp // 4, 4, 32, 4).transpose(2, 3).reshape(-1)


def _scales_by_row_group(scales: torch.Tensor, counts) -> torch.Tensor:
    """2-D × 3-D ``mat_a`` scales: ``[N, C]`` blocked one group of rows at a time."""
    parts = [to_blocked(s) for s, c in zip(scales.split(list(counts)), counts) if c]
    flat = torch.cat(parts) if parts else scales.new_zeros(0)
    return flat.view(-1, _round_up(scales.shape[1], 4)).view(E8M0)


def _scales_by_col_group(scales: torch.Tensor, counts) -> torch.Tensor:
    """2-D × 2-D scales: ``[R, N/32]`` blocked one group of columns (an expert's tokens) at a time."""
    blocks = [c // MX_BLOCK for c in counts]
    parts = [to_blocked(s) for s, b in zip(scales.split(blocks, dim=1), blocks) if b]
    flat = torch.cat(parts) if parts else scales.new_zeros(0)
    return flat.view(_round_up(scales.shape[0], 128), -1).view(E8M0)


def _scales_per_expert(scales: torch.Tensor) -> torch.Tensor:
    """3-D ``mat_b`` scales ``[L, N, K/32]``: ``[L, blocked]``, each expert blocked on its own."""
    return torch.stack([to_blocked(s) for s in scales.unbind(0)]).view(E8M0)


def _op():
    return torch._scaled_grouped_mm  # looked up per call (the CPU tests put a stand-in there)


def _quantize(t: torch.Tensor):
    return quantize_mxfp8(t.contiguous(), MX_BLOCK, "rceil")


def mx_forward(x_NI, w_LOI, counts, offs_L, out_dtype):
    """``y = x·w[e]ᵀ``: both operands blocked along I."""
    xq_NI, xs = _quantize(x_NI)
    wq_LOI, ws = _quantize(w_LOI)
    return _op()(
        xq_NI,
        wq_LOI.transpose(-2, -1),
        _scales_by_row_group(xs, counts),
        _scales_per_expert(ws),
        offs=offs_L,
        out_dtype=out_dtype,
    )


def mx_dgrad(dy_NO, w_LOI, counts, offs_L, out_dtype):
    """``dx = dy·w[e]``: the forward GEMM with ``dy`` blocked along O and ``w`` re-quantized along O."""
    return mx_forward(dy_NO, w_LOI.transpose(-2, -1), counts, offs_L, out_dtype)


def mx_wgrad_input(x_NI, counts_L, counts):
    """x as the weight gradient reads it, kept from the forward: ``xᵀ [I, N]`` in MXFP8 blocked along each
    expert's tokens (rows per expert are multiples of 32: no block straddles two experts), and its
    ``[I, N/32]`` scale bytes."""
    return _quantize(x_NI.t())


def mx_wgrad(dy_NO, x_kept, counts_L, offs_L, out_dtype, counts):
    """``dw[e] = dy[rows of e]ᵀ·x[rows of e]``: both blocked along each expert's tokens (``x_kept``: the
    codes and scales of :func:`mx_wgrad_input`)."""
    xq_IN, xs = x_kept
    gq_ON, gs = _quantize(dy_NO.t())
    return _op()(
        gq_ON,
        xq_IN.t(),
        _scales_by_col_group(gs, counts),
        _scales_by_col_group(xs, counts),
        offs=offs_L,
        out_dtype=out_dtype,
    )
