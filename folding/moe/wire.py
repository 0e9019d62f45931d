"""Wire formats and the token exchanges of the all-to-all dispatcher (autograd functions).

Rows travel as bytes so that any backend can carry them (gloo cannot send float8): every row of a
message is ``[hidden payload | scales | optional fp32 probability]`` packed into one ``uint8`` row, so
tokens and their router probabilities cross the EP all-to-all in one collective. Formats:

- ``none``: the activation dtype, bit for bit (exact).
- ``fp8``: e4m3 values with one fp32 scale per row (``folding.quant.quantize_fp8_rowwise``).
- ``mxfp8``: e4m3 values with one e8m0 scale per 32 elements, ``rceil`` rule so nothing saturates
  (``folding.quant.quantize_mxfp8``); ``(H + H/32)`` bytes per row instead of ``2H`` in bf16.

Quantization happens only at the EP boundary: the ETP all-gather forwards the already encoded bytes
(no second rounding), while ETP reductions (sums of partial results) run in the activation dtype.
Gradients are straight-through (quantization is treated as the identity) and travel in the format
``grad_wire``.

Shape-suffix legend: ``N`` rows, ``H`` hidden size, ``Y`` bytes per packed row (``B`` is the batch elsewhere).

Usage (inside a dispatcher)::

    spec = ExchangeSpec(ep_group=..., etp_group=..., ep_send=plan.input_splits, ep_recv=plan.output_splits,
                        etp_sizes=plan.etp_sizes, wire="mxfp8", grad_wire="none")
    rows_NH, probs_N = dispatch_exchange(rows_NH, probs_N, spec)
    out_NH = combine_exchange(out_NH, spec_for_combine)
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ..parallel.collectives import all_gather_single, group_rank, group_size
from ..quant import dequantize_fp8_rowwise, dequantize_mxfp8, quantize_fp8_rowwise, quantize_mxfp8

WIRE_FORMATS = ("none", "fp8", "mxfp8")
MX_BLOCK = 32
_QUANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_wire(setting: str, fmt: str, dtype: torch.dtype, hidden_size: int) -> None:
    """Raise ``ValueError`` naming ``setting`` if format ``fmt`` cannot carry ``dtype`` rows of ``hidden_size``."""
    if fmt not in WIRE_FORMATS:
        raise ValueError(f"{setting}={fmt!r} is not a wire format; choose one of {WIRE_FORMATS}")
    if fmt == "none":
        return
    if dtype not in _QUANT_DTYPES:
        raise ValueError(
            f"{setting}={fmt!r} quantizes from fp32/bf16/fp16 activations, not {dtype}; "
            f"set {setting}=none or run the layer in bf16/fp32"
        )
    if fmt == "mxfp8" and hidden_size % MX_BLOCK:
        raise ValueError(
            f"{setting}=mxfp8 needs the hidden size to be a multiple of {MX_BLOCK} "
            f"(got {hidden_size}); use {setting}=fp8 or none"
        )


def payload_bytes_per_row(fmt: str, hidden_size: int, dtype: torch.dtype) -> int:
    """Bytes of one row's hidden payload on the wire, scales included (probabilities excluded)."""
    if fmt == "none":
        return hidden_size * torch.empty((), dtype=dtype).element_size()
    if fmt == "fp8":
        return hidden_size + 4
    return hidden_size + hidden_size // MX_BLOCK


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(x.shape[0], math.prod(x.shape[1:]))  # explicit width: N may be 0
    if x.stride(-1) != 1 or not x.is_contiguous():
        x = torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)
    return x.view(torch.uint8)


def encode(x_NH: torch.Tensor, fmt: str, probs_N: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pack rows (and optionally one probability per row, in its own dtype) into ``uint8 [N, B]``."""
    if fmt == "none":
        parts = [_as_bytes(x_NH)]
    elif fmt == "fp8":
        data, scale_inv = quantize_fp8_rowwise(x_NH)
        parts = [_as_bytes(data), _as_bytes(scale_inv.to(torch.float32).reshape(-1, 1))]
    else:
        data, scales = quantize_mxfp8(x_NH, block_size=MX_BLOCK, scale_mode="rceil")
        parts = [_as_bytes(data), _as_bytes(scales)]
    if probs_N is not None:
        parts.append(_as_bytes(probs_N.detach().reshape(-1, 1)))
    if len(parts) == 1:
        return parts[0]
    # concatenate in the widest integer carrier that divides every part's row width (much faster
    # than a byte-wise cat), then reinterpret as bytes
    for carrier in (torch.int64, torch.int32, torch.int16, torch.uint8):
        size = torch.empty((), dtype=carrier).element_size()
        if all(q.shape[1] % size == 0 for q in parts):
            return torch.cat([q.view(carrier) for q in parts], dim=1).view(torch.uint8)


def _view(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a column slice of packed byte rows as ``dtype`` without a copy when strides allow."""
    try:
        return b.view(dtype)
    except RuntimeError:  # a fresh buffer (storage offset 0): .contiguous() keeps empty views' offsets
        return torch.empty(b.shape, dtype=b.dtype, device=b.device).copy_(b).view(dtype)


def decode(
    b_NY: torch.Tensor, fmt: str, hidden_size: int, dtype: torch.dtype, probs_dtype: Optional[torch.dtype] = None
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Inverse of :func:`encode`: ``(x_NH in dtype, probs_N in probs_dtype, or None without probs)``.

    For ``none`` the results are views into ``b_NY`` where the row stride allows it (no copy)."""
    H = hidden_size
    n = b_NY.shape[0]
    pay = payload_bytes_per_row(fmt, H, dtype)
    body = b_NY[:, :pay]
    if fmt == "none":
        x = _view(body, dtype).reshape(n, H)
    elif fmt == "fp8":
        data = _view(body[:, :H], torch.float8_e4m3fn)
        scale_inv = _view(body[:, H:], torch.float32).reshape(n, 1)
        x = dequantize_fp8_rowwise(data, scale_inv, dtype)
    else:
        data = _view(body[:, :H], torch.float8_e4m3fn)
        scales = body[:, H:]
        x = dequantize_mxfp8(data, scales, dtype)
    probs = None
    if probs_dtype is not None:
        probs = _view(b_NY[:, pay:], probs_dtype).reshape(n)
    return x, probs


# ------------------------------------------------------------------------------- raw byte moves


def _size(group) -> int:
    return group_size(group)


def _a2a(x: torch.Tensor, group, recv: List[int], send: List[int]) -> torch.Tensor:
    """Uneven all_to_all_single along dim 0 (no autograd)."""
    if _size(group) == 1:
        return x
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(
        out, x.contiguous(), output_split_sizes=list(recv), input_split_sizes=list(send), group=group
    )
    return out


def _gather_v(x: torch.Tensor, group, sizes: List[int]) -> torch.Tensor:
    """All-gather along dim 0 where rank ``i`` holds ``sizes[i]`` rows (padded all-gather)."""
    n = _size(group)
    if n == 1:
        return x
    m = max(sizes)
    pad = x.new_zeros((m,) + tuple(x.shape[1:]))
    pad[: x.shape[0]] = x
    out = x.new_empty((n * m,) + tuple(x.shape[1:]))
    all_gather_single(out, pad, group=group)
    if all(s == m for s in sizes):
        return out
    return torch.cat([out[i * m : i * m + s] for i, s in enumerate(sizes)], dim=0)


def _reduce_scatter_v(x: torch.Tensor, group, sizes: List[int]) -> torch.Tensor:
    """Sum over the group; rank ``i`` keeps rows ``[sum(sizes[:i]), sum(sizes[:i+1]))`` (all-to-all, then add)."""
    n = _size(group)
    if n == 1:
        return x
    me = group_rank(group)
    recv = _a2a(x, group, [sizes[me]] * n, list(sizes))
    return recv.view((n, sizes[me]) + tuple(x.shape[1:])).sum(0)


@dataclasses.dataclass(frozen=True)
class ExchangeSpec:
    """Everything one token exchange needs (host-side sizes, groups, formats)."""

    ep_group: object
    """The expert-parallel group (all-to-all)."""
    etp_group: object
    """The expert-tensor-parallel group (all-gather / reduce-scatter)."""
    ep_send: List[int]
    """Rows this rank sends to each EP rank on dispatch (its permuted rows)."""
    ep_recv: List[int]
    """Rows this rank receives from each EP rank on dispatch."""
    etp_sizes: List[int]
    """Rows each ETP rank holds after the EP all-to-all."""
    wire: str
    """Format of the forward message."""
    grad_wire: str
    """Format of the backward message."""
    hidden_size: int
    """H."""
    dtype: torch.dtype
    """Activation dtype (what decode returns)."""


class _Dispatch(torch.autograd.Function):
    """Forward: encode → EP all-to-all → ETP all-gather-v (of the bytes) → decode.
    Backward: ETP reduce-scatter-v (activation dtype) → encode(grad_wire) → reverse EP all-to-all → decode."""

    @staticmethod
    def forward(ctx, rows_NH, probs_N, spec: ExchangeSpec):
        ctx.spec = spec
        ctx.probs_dtype = None if probs_N is None else probs_N.dtype
        b = encode(rows_NH, spec.wire, probs_N)
        b = _a2a(b, spec.ep_group, spec.ep_recv, spec.ep_send)
        b = _gather_v(b, spec.etp_group, spec.etp_sizes)
        return decode(b, spec.wire, spec.hidden_size, spec.dtype, ctx.probs_dtype)

    @staticmethod
    def backward(ctx, g_NH, gp_N):
        s, pdt = ctx.spec, ctx.probs_dtype
        rows = sum(s.etp_sizes)
        if g_NH is None:
            g_NH = torch.zeros((rows, s.hidden_size), dtype=s.dtype)
        if pdt is not None and gp_N is None:
            gp_N = torch.zeros(rows, dtype=pdt, device=g_NH.device)
        if _size(s.etp_group) > 1:
            # The ETP ranks hold partial gradients of the same rows: sum them (hidden and
            # probability gradients in one reduction, in a dtype that holds both exactly enough).
            acc = torch.float64 if torch.float64 in (s.dtype, pdt) else torch.float32
            both = g_NH.to(acc) if pdt is None else torch.cat([g_NH.to(acc), gp_N.reshape(-1, 1).to(acc)], 1)
            both = _reduce_scatter_v(both, s.etp_group, s.etp_sizes)
            g_NH = both[:, : s.hidden_size].to(s.dtype)
            gp_N = None if pdt is None else both[:, s.hidden_size].to(pdt)
        b = encode(g_NH, s.grad_wire, gp_N)
        b = _a2a(b, s.ep_group, s.ep_send, s.ep_recv)
        gx, gp = decode(b, s.grad_wire, s.hidden_size, s.dtype, pdt)
        return gx, gp, None


class _Combine(torch.autograd.Function):
    """Forward: ETP reduce-scatter-v (activation dtype) → encode → reverse EP all-to-all → decode.
    Backward: encode(grad_wire) → EP all-to-all → ETP all-gather-v (of the bytes) → decode."""

    @staticmethod
    def forward(ctx, out_NH, spec: ExchangeSpec):
        ctx.spec = spec
        x = _reduce_scatter_v(out_NH, spec.etp_group, spec.etp_sizes)
        b = encode(x, spec.wire)
        b = _a2a(b, spec.ep_group, spec.ep_send, spec.ep_recv)
        y, _ = decode(b, spec.wire, spec.hidden_size, spec.dtype)
        return y

    @staticmethod
    def backward(ctx, g_NH):
        s = ctx.spec
        b = encode(g_NH.contiguous(), s.grad_wire)
        b = _a2a(b, s.ep_group, s.ep_recv, s.ep_send)
        b = _gather_v(b, s.etp_group, s.etp_sizes)
        gx, _ = decode(b, s.grad_wire, s.hidden_size, s.dtype)
        return gx, None


def dispatch_exchange(
    rows_NH: torch.Tensor, probs_N: Optional[torch.Tensor], spec: ExchangeSpec
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Move permuted rows (and their probabilities) to the ranks of their experts.

    Forward: EP all-to-all with splits ``(ep_send → ep_recv)``, then ETP all-gather-v, in ``spec.wire``.
    Backward: ETP reduce-scatter-v (sum of the ETP ranks' partial gradients), then the reverse EP
    all-to-all in ``spec.grad_wire``. Returns rows in rank-major order ``[etp j][ep src s][expert l]``.
    """
    return _Dispatch.apply(rows_NH, probs_N, spec)


def combine_exchange(out_NH: torch.Tensor, spec: ExchangeSpec) -> torch.Tensor:
    """Bring expert outputs (rank-major, as :func:`dispatch_exchange` left them) back to their senders.

    Forward: ETP reduce-scatter-v (sums ETP partial outputs), then the reverse EP all-to-all in
    ``spec.wire``. Backward: the EP all-to-all in ``spec.grad_wire``, then ETP all-gather-v.
    """
    return _Combine.apply(out_NH, spec)
