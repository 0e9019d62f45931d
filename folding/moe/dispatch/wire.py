"""Wire formats and the token exchanges of the all-to-all dispatcher (autograd functions).

Rows travel as bytes so that any backend can carry them (gloo cannot send float8). A message is a
list of ``uint8`` parts, each sent as its own collective, so nothing is copied to pack them: the
rows (for ``none`` their own bytes, a view of the permuted rows), for quantized formats their scales
beside them, and the router probabilities (in their own dtype) as one more small part. Formats:

- ``none``: the activation dtype, bit for bit (exact).
- ``fp8``: e4m3 values with one fp32 power-of-two scale per row (``folding.quant.quantize_fp8_rowwise``),
  the operand format of the ``rowwise`` expert recipe: rows decode exactly into bf16, and the experts'
  rowwise quantization of fc1's input gives back the same values (no second rounding).
- ``mxfp8``: e4m3 values with one e8m0 scale per 32 elements, ``rceil`` rule so nothing saturates
  (``folding.quant.quantize_mxfp8``); ``(H + H/32)`` bytes per row instead of ``2H`` in bf16. The
  ``mxfp8`` expert recipe re-quantizes these rows to the same values.

Quantization happens only at the EP boundary: the ETP all-gather forwards the already encoded bytes
(no second rounding), while ETP reductions (sums of partial results) run in the activation dtype.
Gradients are straight-through (quantization is treated as the identity) and travel in the format
``grad_wire``.

Shape suffixes (docs/shapes.md): ``N`` rows, ``H`` hidden size.

Usage (inside a dispatcher)::

    spec = ExchangeSpec(ep_group=..., etp_group=..., ep_send=plan.input_splits, ep_recv=plan.output_splits,
                        etp_sizes=plan.etp_sizes, wire="mxfp8", grad_wire="none")
    rows_NH, probs_N = dispatch_exchange(rows_NH, probs_N, spec)
    out_NH = combine_exchange(out_NH, spec_for_combine)
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ...overlap.exchange import ETP_ROWS, TOKENS, Exchange, Message
from ...overlap.runtime import current_runtime, entered
from ...parallel.collectives import all_gather_single, group_rank, group_size
from ...quant import dequantize, quantize_fp8_rowwise, quantize_mxfp8
from .permute import inverse_order

WIRE_FORMATS = ("none", "fp8", "mxfp8")
MX_BLOCK = 32
_QUANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_wire_format(setting: str, fmt: str) -> None:
    """Raise ``ValueError`` naming ``setting`` unless ``fmt`` is one of :data:`WIRE_FORMATS` (checked
    once, when a dispatcher is built)."""
    if fmt not in WIRE_FORMATS:
        raise ValueError(f"{setting}={fmt!r} is not a wire format; choose one of {WIRE_FORMATS}")


def check_wire(setting: str, fmt: str, dtype: torch.dtype, hidden_size: int) -> None:
    """Raise ``ValueError`` naming ``setting`` if format ``fmt`` (a wire format,
    :func:`check_wire_format`) cannot carry ``dtype`` rows of ``hidden_size`` (known per call)."""
    assert fmt in WIRE_FORMATS, "checked by check_wire_format when the dispatcher was built"
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
    if x.stride(-1) != 1 or not x.is_contiguous():  # empty tensors count as contiguous at any stride
        x = torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)
    return x.view(torch.uint8)


def encode(x_NH: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, ...]:
    """Rows as the ``uint8 [N, *]`` parts that travel (no concatenation: each part is its own message).

    ``none``: one part, the rows' own bytes (a view when ``x_NH`` is contiguous: no copy). ``fp8``: the
    e4m3 values and one fp32 scale per row. ``mxfp8``: the e4m3 values and the e8m0 block scales."""
    if fmt == "none":
        return (_as_bytes(x_NH),)
    if fmt == "fp8":
        data, scale_inv = quantize_fp8_rowwise(x_NH, power_2_scale=True)
        return _as_bytes(data), _as_bytes(scale_inv.to(torch.float32).reshape(-1, 1))
    data, scales = quantize_mxfp8(x_NH, block_size=MX_BLOCK, scale_mode="rceil")
    return _as_bytes(data), _as_bytes(scales)


def decode(parts: Sequence[torch.Tensor], fmt: str, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`encode`: rows ``[N, H]`` in ``dtype`` (for ``none`` a view of the received bytes)."""
    H, n = hidden_size, parts[0].shape[0]
    if fmt == "none":
        return parts[0].view(dtype).reshape(n, H)
    data = parts[0].view(torch.float8_e4m3fn)
    if fmt == "fp8":
        return dequantize(data, parts[1].view(torch.float32).reshape(n, 1), dtype)
    return dequantize(data, parts[1], dtype, block=(1, MX_BLOCK))


# ------------------------------------------------------------------------------- raw byte moves


def _size(group) -> int:
    return group_size(group)


def _a2a_all(
    parts: Sequence[torch.Tensor], group, recv, send, rows: Optional[int] = None, *, what: str, carries: str = TOKENS
) -> List[torch.Tensor]:
    """Uneven ``all_to_all_single`` of every part along dim 0 (no autograd), issued together and then
    waited on as one :class:`~folding.overlap.exchange.Exchange` named ``what`` carrying ``carries``
    (see :func:`_a2a_start`)."""
    outs, works, messages = _a2a_start(parts, group, recv, send, rows)
    _wait(works, what, carries=carries, group=group, messages=messages)
    return outs


def _wait(works, what: str, *, carries: str, group=None, messages: Sequence[Message] = ()) -> None:
    """Wait on collectives issued together on ``group`` as one exchange record: the overlap point of
    every token exchange (deferred work and the other lane of a pair run here while they are in flight;
    see :mod:`folding.overlap.exchange`)."""
    if works:
        Exchange(works, what=what, carries=carries, group=group, messages=messages).wait()


def _a2a_start(parts: Sequence[torch.Tensor], group, recv, send, rows: Optional[int] = None):
    """Issue the uneven ``all_to_all_single`` of every part along dim 0 (no autograd) and return
    ``(outputs, works, messages)``, the outputs valid once every work is waited on, ``messages`` one
    :class:`~folding.overlap.exchange.Message` per collective issued: all are issued before any
    is waited on, so the parts of one message cost one synchronization, not one each. With
    ``rows`` (>= ``sum(recv)``) each output has that many rows, the received ones first (the rest
    uninitialized): a padded buffer the ETP all-gather can send as it is.

    ``recv`` / ``send`` are the split sizes per rank, or lists of them (*slices*): then slice ``i``
    is its own all-to-all of the ``i``-th contiguous block of the input (``sum(send[i])`` rows) into
    the ``i``-th block of the output (``sum(recv[i])`` rows), all issued together: the received rows
    come out grouped by slice, then by source rank."""
    sliced = len(recv) > 0 and isinstance(recv[0], (list, tuple))
    recv_s, send_s = (list(recv), list(send)) if sliced else ([recv], [send])
    if _size(group) == 1 and rows is None:
        return list(parts), [], []
    n_in = sum(sum(r) for r in recv_s)
    outs, works, messages = [], [], []
    for x in parts:
        out = x.new_empty((max(n_in, rows or 0),) + tuple(x.shape[1:]))
        x = x.contiguous()
        i0 = o0 = 0
        for r, sd in zip(recv_s, send_s):
            ni, no = sum(sd), sum(r)
            if _size(group) == 1:
                out[o0 : o0 + no].copy_(x[i0 : i0 + ni])
            else:
                sd, r = list(sd), list(r)
                messages.append(Message(group, sd, r, math.prod(x.shape[1:]) * x.element_size()))
                works.append(
                    dist.all_to_all_single(
                        out[o0 : o0 + no],
                        x[i0 : i0 + ni],
                        output_split_sizes=r,
                        input_split_sizes=sd,
                        group=group,
                        async_op=True,
                    )
                )
            i0, o0 = i0 + ni, o0 + no
        outs.append(out)
    return outs, works, messages


def _gather_all(
    parts: Sequence[torch.Tensor], group, sizes: List[int], keep_padding: bool = False
) -> List[torch.Tensor]:
    """All-gather along dim 0 of every part, where rank ``i`` holds ``sizes[i]`` rows (padded
    all-gathers, issued together and waited once). A part may arrive already padded to
    ``max(sizes)`` rows. ``keep_padding`` returns the padded ``[n·max(sizes)]`` blocks (rank ``i``'s
    rows first in block ``i``, the rest undefined) for a caller that drops the padding in a copy it
    makes anyway. One size means no ETP exchange."""
    n = len(sizes)
    if n == 1:
        return list(parts)
    m = max(sizes)
    outs, works = [], []
    for x in parts:
        if x.shape[0] != m:
            pad = x.new_zeros((m,) + tuple(x.shape[1:]))
            pad[: x.shape[0]] = x
            x = pad
        out = x.new_empty((n * m,) + tuple(x.shape[1:]))
        works.append(all_gather_single(out, x.contiguous(), group=group, async_op=True))
        outs.append(out)
    _wait(works, "etp all-gather", carries=ETP_ROWS, group=group)
    if keep_padding or all(s == m for s in sizes):
        return outs
    return [torch.cat([out[i * m : i * m + s] for i, s in enumerate(sizes)], dim=0) for out in outs]


def _reduce_scatter_all(parts: Sequence[torch.Tensor], group, sizes: List[int]) -> List[torch.Tensor]:
    """Sum every part over the group; rank ``i`` keeps rows ``[sum(sizes[:i]), sum(sizes[:i+1]))``
    (an all-to-all of the blocks, issued together for all parts, then a local sum). One size means
    no ETP exchange."""
    n = len(sizes)
    if n == 1:
        return list(parts)
    me = group_rank(group)
    recv = _a2a_all(parts, group, [sizes[me]] * n, list(sizes), what="etp reduce-scatter", carries=ETP_ROWS)
    return [r.view((n, sizes[me]) + tuple(r.shape[1:])).sum(0) for r in recv]


@dataclasses.dataclass(frozen=True)
class ExchangeSpec:
    """Everything one token exchange needs (host-side sizes, groups, formats)."""

    ep_group: object
    """The expert-parallel group (all-to-all)."""
    etp_group: object
    """The expert-tensor-parallel group (all-gather / reduce-scatter)."""
    ep_send: list
    """Rows this rank sends to each EP rank on dispatch (its permuted rows); or, sliced, one such
    list per local expert index (:attr:`folding.moe.dispatch.permute.AllToAllPlan.expert_slices`)."""
    ep_recv: list
    """Rows this rank receives from each EP rank on dispatch; or one such list per slice."""
    etp_sizes: List[int]
    """Rows each ETP rank holds after the EP all-to-all; a single entry (this rank's) leaves the ETP
    exchange out of this message (it then runs apart: :func:`etp_gather`, :func:`etp_reduce_scatter`)."""
    wire: str
    """Format of the forward message."""
    grad_wire: str
    """Format of the backward message."""
    hidden_size: int
    """H."""
    dtype: torch.dtype
    """Activation dtype (what decode returns)."""
    probs_send: Optional[list] = None
    """Sliced rows (``ep_send`` a list per local expert index): the probabilities still travel as one
    all-to-all, rank-major, with these split sizes per EP rank (and ``probs_recv``); ``None`` sends
    them with the rows' splits."""
    probs_recv: Optional[list] = None
    """Rows of probabilities this rank receives from each EP rank (with ``probs_send``)."""
    etp_padded: bool = False
    """Rows on the expert side of the ETP exchange are in padded blocks of ``max(etp_sizes)`` rows
    per ETP rank (this rank's rows first in its own). Dispatch: the ETP-gathered rows are returned
    so (see :func:`padded_chunks`), and the dispatcher's expert-major sort drops the padding in the
    copy it makes anyway. Combine: the partial outputs come in so (see :func:`to_padded_blocks`,
    the padding written by the unsort it makes anyway) and are reduce-scattered in equal blocks,
    so that the gradient's all-gather is returned as it arrives, with no copy to drop the padding."""


def _sum_etp_grads(g_NH: torch.Tensor, gp_N: Optional[torch.Tensor], group, sizes: List[int], padded: bool = False):
    """Backward of an ETP all-gather of rows (and their probabilities): the ETP ranks hold partial
    gradients of the same rows, so reduce-scatter them (16-bit rows summed in fp32). ``padded``: the
    gradient is in padded blocks of ``max(sizes)`` rows per rank, this rank's rows first in its own."""
    low = g_NH.dtype in (torch.bfloat16, torch.float16)
    me, m = group_rank(group), max(sizes)
    red = _reduce_scatter_all(
        [g_NH.float() if low else g_NH] + _probs_part(gp_N), group, [m] * len(sizes) if padded else sizes
    )
    mine = sizes[me]
    return red[0][:mine].to(g_NH.dtype), (None if gp_N is None else red[1][:mine].reshape(-1))


def _probs_part(probs_N: Optional[torch.Tensor]) -> List[torch.Tensor]:
    return [] if probs_N is None else [probs_N.detach().reshape(-1, 1)]


def _ep_exchange(rows_parts, probs_parts, spec: ExchangeSpec, backward: bool, rows: Optional[int] = None, what=""):
    """The EP all-to-all of the rows' parts and the probabilities' part (forward: dispatch direction;
    ``backward``: the reverse), all issued before any is waited on; the probabilities with their own
    splits when ``spec.probs_send`` is set (sliced rows, one probabilities call)."""
    send, recv = (spec.ep_recv, spec.ep_send) if backward else (spec.ep_send, spec.ep_recv)
    if spec.probs_send is None:
        return _a2a_all(list(rows_parts) + list(probs_parts), spec.ep_group, recv, send, rows=rows, what=what)
    p_send, p_recv = (spec.probs_recv, spec.probs_send) if backward else (spec.probs_send, spec.probs_recv)
    outs, works, messages = _a2a_start(rows_parts, spec.ep_group, recv, send, rows=rows)
    p_outs, p_works, p_messages = _a2a_start(probs_parts, spec.ep_group, p_recv, p_send)
    _wait(works + p_works, what, carries=TOKENS, group=spec.ep_group, messages=messages + p_messages)
    return outs + p_outs


class _Dispatch(torch.autograd.Function):
    """Forward: encode → EP all-to-all → ETP all-gather-v (of the encoded parts) → decode; the
    probabilities travel as their own message beside the rows.
    Backward: ETP reduce-scatter-v → encode(grad_wire) → reverse EP all-to-all → decode."""

    @staticmethod
    def forward(ctx, rows_NH, probs_N, spec: ExchangeSpec):
        ctx.spec, ctx.overlap = spec, current_runtime()
        ctx.probs_dtype = None if probs_N is None else probs_N.dtype
        m = max(spec.etp_sizes) if len(spec.etp_sizes) > 1 else None  # receive straight into the padded block
        parts = _ep_exchange(
            encode(rows_NH, spec.wire), _probs_part(probs_N), spec, backward=False, rows=m, what="ep dispatch"
        )
        parts = _gather_all(parts, spec.etp_group, spec.etp_sizes, keep_padding=spec.etp_padded)
        if probs_N is None:
            return decode(parts, spec.wire, spec.hidden_size, spec.dtype), None
        return decode(parts[:-1], spec.wire, spec.hidden_size, spec.dtype), parts[-1].reshape(-1)

    @staticmethod
    def backward(ctx, g_NH, gp_N):
        with entered(ctx.overlap):  # the forward's overlap runtime (on CUDA this runs on another thread)
            return _Dispatch._backward(ctx, g_NH, gp_N)

    @staticmethod
    def _backward(ctx, g_NH, gp_N):
        s, pdt = ctx.spec, ctx.probs_dtype  # autograd materializes unused gradients as zeros
        if len(s.etp_sizes) > 1:
            g_NH, gp_N = _sum_etp_grads(g_NH, gp_N, s.etp_group, s.etp_sizes, padded=s.etp_padded)
        parts = _ep_exchange(
            encode(g_NH, s.grad_wire), _probs_part(gp_N), s, backward=True, what="ep dispatch backward"
        )
        if pdt is None:
            return decode(parts, s.grad_wire, s.hidden_size, s.dtype), None, None
        return decode(parts[:-1], s.grad_wire, s.hidden_size, s.dtype), parts[-1].reshape(-1), None


class _Combine(torch.autograd.Function):
    """Forward: ETP reduce-scatter-v (activation dtype) → encode → reverse EP all-to-all → decode.
    Backward: encode(grad_wire) → EP all-to-all → ETP all-gather-v (of the encoded parts) → decode.
    With ``spec.etp_padded`` the expert-side rows are in padded blocks both ways."""

    @staticmethod
    def forward(ctx, out_NH, spec: ExchangeSpec):
        ctx.spec, ctx.overlap = spec, current_runtime()
        sizes = spec.etp_sizes
        if spec.etp_padded:  # equal blocks of max(sizes) rows; this rank's rows lead its own
            (x,) = _reduce_scatter_all([out_NH], spec.etp_group, [max(sizes)] * len(sizes))
            x = x[: sizes[group_rank(spec.etp_group)]]
        else:
            (x,) = _reduce_scatter_all([out_NH], spec.etp_group, sizes)
        parts = _a2a_all(encode(x, spec.wire), spec.ep_group, spec.ep_send, spec.ep_recv, what="ep combine")
        return decode(parts, spec.wire, spec.hidden_size, spec.dtype)

    @staticmethod
    def backward(ctx, g_NH):
        s = ctx.spec
        m = max(s.etp_sizes) if len(s.etp_sizes) > 1 else None  # receive straight into the padded block
        with entered(ctx.overlap):  # the forward's overlap runtime (on CUDA this runs on another thread)
            parts = _a2a_all(
                encode(g_NH, s.grad_wire), s.ep_group, s.ep_recv, s.ep_send, rows=m, what="ep combine backward"
            )
            parts = _gather_all(parts, s.etp_group, s.etp_sizes, keep_padding=s.etp_padded)
        return decode(parts, s.grad_wire, s.hidden_size, s.dtype), None


class _EtpGather(torch.autograd.Function):
    """Forward: ETP all-gather-v of rows and probabilities (activation dtype).
    Backward: ETP reduce-scatter-v of their gradients (16-bit rows summed in fp32)."""

    @staticmethod
    def forward(ctx, rows_NH, probs_N, group, sizes: List[int]):
        ctx.group, ctx.sizes, ctx.has_probs = group, sizes, probs_N is not None
        ctx.overlap = current_runtime()
        parts = _gather_all([rows_NH.contiguous()] + _probs_part(probs_N), group, sizes)
        return parts[0], (parts[1].reshape(-1) if ctx.has_probs else None)

    @staticmethod
    def backward(ctx, g_NH, gp_N):
        gp_N = gp_N if ctx.has_probs else None  # autograd materializes unused gradients as zeros
        with entered(ctx.overlap):
            g_NH, gp_N = _sum_etp_grads(g_NH, gp_N, ctx.group, ctx.sizes)
        return g_NH, gp_N, None, None


class _EtpReduceScatter(torch.autograd.Function):
    """Forward: ETP reduce-scatter-v (sum of the ETP ranks' partial outputs, activation dtype).
    Backward: ETP all-gather-v of the gradient."""

    @staticmethod
    def forward(ctx, out_NH, group, sizes: List[int]):
        ctx.group, ctx.sizes, ctx.overlap = group, sizes, current_runtime()
        return _reduce_scatter_all([out_NH], group, sizes)[0]

    @staticmethod
    def backward(ctx, g_NH):
        with entered(ctx.overlap):
            return _gather_all([g_NH.contiguous()], ctx.group, ctx.sizes)[0], None, None


def etp_gather(
    rows_NH: torch.Tensor, probs_N: Optional[torch.Tensor], etp_group, sizes: List[int]
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The ETP half of a dispatch on its own, in the activation dtype (Megatron-Core's placement, in
    ``dispatch_postprocess``). Forward: all-gather-v over ``etp_group`` (rank ``i`` holds ``sizes[i]``
    rows). Backward: reduce-scatter-v of the gradients (the ETP ranks' partial gradients summed)."""
    if group_size(etp_group) == 1:
        return rows_NH, probs_N
    return _EtpGather.apply(rows_NH, probs_N, etp_group, list(sizes))


def etp_reduce_scatter(out_NH: torch.Tensor, etp_group, sizes: List[int]) -> torch.Tensor:
    """The ETP half of a combine on its own (Megatron-Core's placement, in ``combine_preprocess``).
    Forward: reduce-scatter-v over ``etp_group`` (sums partial outputs; rank ``i`` keeps ``sizes[i]``
    rows). Backward: all-gather-v of the gradient."""
    if group_size(etp_group) == 1:
        return out_NH
    return _EtpReduceScatter.apply(out_NH, etp_group, list(sizes))


def padded_chunks(chunk_sizes: Sequence[int], order: Sequence[int], etp_sizes: Sequence[int]):
    """Chunk sizes and order over the padded ETP blocks of :attr:`ExchangeSpec.etp_padded`: after
    each ETP rank's ``len(chunk_sizes) / ETP`` chunks comes a padding chunk of ``max(etp_sizes) -
    etp_sizes[j]`` rows, which ``order`` (re-indexed) leaves out. Returns ``(sizes, order)`` for
    :func:`folding.moe.dispatch.permute.sort_chunks_by_idxs`."""
    n, m = len(etp_sizes), max(etp_sizes)
    per = len(chunk_sizes) // n
    sizes: List[int] = []
    for j in range(n):
        sizes += list(chunk_sizes[j * per : (j + 1) * per]) + [m - etp_sizes[j]]
    return sizes, [c + c // per for c in order]


def to_padded_blocks(x: torch.Tensor, chunk_sizes: Sequence[int], order: Sequence[int], etp_sizes: Sequence[int]):
    """The combine's unsort into padded ETP blocks: ``x`` holds the rank-major chunks
    ``chunk_sizes`` in the order ``order`` (expert-major, as the experts produced them); the result
    holds them rank-major with each ETP rank's block followed by ``max(etp_sizes) - etp_sizes[j]``
    zero rows, the layout :class:`ExchangeSpec` ``etp_padded`` combines. One copy, the one an unsort
    makes anyway; differentiable (the gradient's padding rows are dropped in the copy back)."""
    n, m = len(etp_sizes), max(etp_sizes)
    per = len(chunk_sizes) // n
    pieces = torch.split(x, [chunk_sizes[i] for i in order], dim=0)
    at = inverse_order(order)  # at[c]: position in x of rank-major chunk c
    out: List[torch.Tensor] = []
    for j in range(n):
        out += [pieces[at[c]] for c in range(j * per, (j + 1) * per)]
        if m > etp_sizes[j]:
            out.append(x.new_zeros((m - etp_sizes[j],) + tuple(x.shape[1:])))
    return torch.cat(out, dim=0)


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
