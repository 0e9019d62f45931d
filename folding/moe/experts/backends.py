"""Grouped-GEMM backends for the experts: ``y[rows of e] = x[rows of e] · w[e]ᵀ`` for every local expert.

Shape suffixes (docs/shapes.md): N rows (tokens routed to this rank's experts, sorted expert-major),
Ne one expert's rows, L local experts, I input features, O output features; ``x_NI``, ``w_LOI``
(nn.Linear-style out×in), ``y_NO``.

Backends (all take the same arguments and give the same result up to round-off):

- ``loop``: one matmul per expert; the reference.
- ``torch``: ``torch.nn.functional.grouped_mm`` (or ``torch._grouped_mm``) where the build has it.
  Its CPU backward rejects stride-0 gradients and strides that are not multiples of 16 bytes, so
  the output's gradient is made contiguous and K / O are zero-padded to 16-byte multiples. With an
  FP8 recipe (``rowwise``, ``mxfp8``): ``torch._scaled_grouped_mm`` (:mod:`folding.moe.experts.scaled`).
- ``emulated``: the loop on FP8/MXFP8-quantized operands (:func:`folding.quant.emulated_linear`).
- ``te``: TransformerEngine ``GroupedLinear`` (see :mod:`folding.moe.experts.te`).

Large inputs: grouped kernels index with 32-bit integers (int32 offsets, and element offsets in
some kernels), so :func:`plan_chunks` splits the rows into calls of fewer than 2^31 elements per
operand, splitting an expert across calls when it alone is too large.

Usage::

    y_NO = grouped_linear(x_NI, w_LOI, counts_L, backend="torch")
"""

from __future__ import annotations

import functools

import torch

from folding.moe.experts.scaled import FEATURE_ALIGN, scaled_grouped_linear
from folding.moe.experts.te import FP8_ROW_ALIGN, pad_rows_per_expert, unpad_rows_per_expert
from folding.overlap import wgrad
from folding.overlap.lanes import LaneError
from folding.quant import emulated_linear

INDEX_LIMIT = 2**31 - 1
"""Largest element count one grouped-GEMM call may address with 32-bit indices."""


def host_counts(tokens_per_expert, num_experts: int, num_rows: int) -> list[int]:
    """``tokens_per_expert`` (list or int tensor, any device) as a validated Python list."""
    if isinstance(tokens_per_expert, torch.Tensor):
        if tokens_per_expert.dim() != 1 or tokens_per_expert.dtype.is_floating_point:
            raise ValueError(
                f"tokens_per_expert must be a 1-D integer tensor [E_local]; got {tokens_per_expert.dtype} "
                f"shape {tuple(tokens_per_expert.shape)}"
            )
        counts = [int(c) for c in tokens_per_expert.tolist()]
    else:
        counts = [int(c) for c in tokens_per_expert]
    if len(counts) != num_experts:
        raise ValueError(
            f"tokens_per_expert has {len(counts)} entries but this rank holds num_local_experts={num_experts}"
        )
    if any(c < 0 for c in counts) or sum(counts) != num_rows:
        raise ValueError(
            f"tokens_per_expert={counts} must be non-negative and sum to the number of token rows "
            f"({num_rows}); sort tokens expert-major and pass the per-expert counts"
        )
    return counts


def plan_chunks(counts: list[int], width: int, limit: int = INDEX_LIMIT) -> list[list[tuple[int, int]]]:
    """Split expert-major rows into calls addressing at most ``limit`` elements of width ``width``.

    Returns a list of calls, each a list of ``(expert, rows)`` pieces in row order; an expert with
    more than ``limit // width`` rows is split across calls. One call when everything fits.
    """
    max_rows = max(1, limit // max(1, width))
    calls: list[list[tuple[int, int]]] = [[]]
    used = 0
    for e, c in enumerate(counts):
        while True:
            take = min(c, max_rows - used)
            if take > 0 or c == 0:
                calls[-1].append((e, take))
                used += take
                c -= take
            if c == 0:
                break
            calls.append([])
            used = 0
    return calls


class _ContiguousGrad(torch.autograd.Function):
    """Identity in forward; backward makes the incoming gradient dense and contiguous (no stride 0)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _grouped_mm_fn():
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


@functools.lru_cache(maxsize=None)
def torch_grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this build runs grouped_mm forward and backward on ``device_type`` / ``dtype`` (probed once,
    when the experts are built: the probe runs a backward, which the second lane of an overlap pair may
    not start, :class:`folding.overlap.lanes.LaneError`)."""
    fn = _grouped_mm_fn()
    if fn is None:
        return False
    try:
        # the probe needs autograd whatever context the first caller is in (e.g. evaluation), and its
        # saved tensors must not reach an enclosing activation checkpoint: the first call may run inside
        # a recomputed region, whose recomputation (probe cached by then) would save fewer tensors
        with (
            torch.inference_mode(False),
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        ):
            return _probe_grouped_mm(fn, device_type, dtype)
    except LaneError:  # run inside an overlap lane: not an answer about the build
        raise
    except Exception:  # noqa: BLE001 - any failure means "not supported on this build"
        return False


def _probe_grouped_mm(fn, device_type: str, dtype: torch.dtype) -> bool:
    """One tiny grouped_mm forward and backward; True when it gives the right answer."""
    x = torch.ones(4, 16, dtype=dtype, device=device_type, requires_grad=True)
    w = torch.ones(2, 16, 16, dtype=dtype, device=device_type, requires_grad=True)
    offs = torch.tensor([2, 4], dtype=torch.int32, device=device_type)
    y = fn(x, w.transpose(-2, -1), offs=offs)
    # backward from a scalar seeds its own gradient: a gradient tensor handed to backward makes torch.autograd
    # import its symbolic-shape helpers (about 0.5 s of CPU), and this probe runs in every process at start.
    # The product hands grouped_mm's backward a dense gradient (a sum's alone is an expanded view)
    (y * torch.ones_like(y)).sum().backward()
    return bool(torch.allclose(y.float(), torch.full((4, 16), 16.0, device=device_type)))


def _pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    pad = (-t.shape[dim]) % multiple
    if pad == 0:
        return t
    spec = [0, 0] * (t.dim() - (dim % t.dim()) - 1) + [0, pad]
    return torch.nn.functional.pad(t, spec)


class _GroupedMMDelayedWgrad(torch.autograd.Function):
    """``y = grouped_mm(x, wᵀ, offs)`` whose backward returns the input gradient at once and defers the
    weight gradient: it hands it to the :class:`~folding.overlap.wgrad.WeightGradPieces` of its
    grouped GEMM, which delivers the pieces of every call of a split GEMM together, once, inside the
    next exchange wait (after that exchange's collectives are issued: the backward dispatch
    all-to-all) or at the end of the backward. Both gradients are the calls torch's own
    ``grouped_mm`` backward makes, so the results are bitwise those of the plain call."""

    @staticmethod
    def forward(ctx, x_NI, w_LOI, offs, anchor):
        ctx.save_for_backward(x_NI, w_LOI, offs)
        ctx.anchor, ctx.pieces = anchor  # the weight as the graph holds it, and the collector of its pieces
        return _grouped_mm_fn()(x_NI, w_LOI.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, g_NO):
        x_NI, w_LOI, offs = ctx.saved_tensors
        fn = _grouped_mm_fn()
        g_NO = g_NO.contiguous()
        gx = fn(g_NO, w_LOI, offs=offs) if ctx.needs_input_grad[0] else None
        if ctx.anchor.requires_grad:
            # torch's own backward for a column-major mat2 (``wᵀ`` of a contiguous ``w``): gᵀ·x;
            # (xᵀ·g)ᵀ sums in another order on some shapes and is not bitwise the same
            ctx.pieces.add(ctx.anchor, lambda: fn(g_NO.transpose(-2, -1), x_NI, offs=offs))
        return gx, None, None, None


def _torch_calls(x_NI: torch.Tensor, w_LOI: torch.Tensor, counts_L: torch.Tensor, rows: int, delay_wgrad: bool):
    """``grouped_mm`` over consecutive ranges of at most ``rows`` rows (one call when they all fit).

    ``counts_L``: the rows per expert as an integer tensor on the inputs' device; every call takes the
    whole weight and its offsets are the experts' row ends clipped to the call's range, computed on
    the device (an expert outside the call is an empty group): no host read, no host→device copy.
    Features are zero-padded to 16-byte multiples once. With ``delay_wgrad`` the calls' weight
    gradients are summed and delivered once (:class:`~folding.overlap.wgrad.WeightGradPieces`)."""
    fn = _grouped_mm_fn()
    out = w_LOI.shape[1]
    align = max(1, 16 // x_NI.element_size())
    xp = _pad_to(x_NI, 1, align).contiguous()
    wp = _pad_to(_pad_to(w_LOI, 2, align), 1, align).contiguous()
    ends_L = counts_L.to(device=x_NI.device, dtype=torch.int64).cumsum(0)
    pieces = None
    if delay_wgrad and wp.requires_grad and torch.is_grad_enabled():
        # the weight enters each call through a detached copy; its gradient reaches ``wp`` (and the
        # parameter, through the padding) in one separate backward call when the deferred work runs
        pieces = wgrad.WeightGradPieces()
    outs, start = [], 0
    for xs in xp.split(rows):  # one node: its backward joins the calls' input gradients in one tensor
        n = xs.shape[0]
        offs = (ends_L if n == xp.shape[0] else (ends_L - start).clamp(0, n)).to(torch.int32)
        if pieces is not None:
            y = _GroupedMMDelayedWgrad.apply(xs, wp.detach(), offs, [wp, pieces])  # a list: not an autograd input
        else:
            y = fn(xs, wp.transpose(-2, -1), offs=offs)
        outs.append(_ContiguousGrad.apply(y))
        start += n
    y = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
    return y[:, :out] if y.shape[1] != out else y


def _loop_call(x_NI, w_LOI, counts, linear, experts):
    # one unbind node: its backward stacks the per-expert gradients into one packed gradient, where
    # per-expert ``w_LOI[e]`` views would each allocate a zero tensor the size of the whole weight
    w_OI = w_LOI.unbind(0)
    outs = []
    for e, x_NeI in zip(experts, x_NI.split(list(counts))):
        if x_NeI.shape[0]:
            outs.append(linear(x_NeI, w_OI[e], e))
    if not outs:  # no rows at all: an empty output that still reaches both inputs in backward
        return x_NI.new_zeros((0, w_LOI.shape[1])) + 0 * w_LOI.sum() + 0 * x_NI.sum()
    return torch.cat(outs, 0)


def grouped_linear(
    x_NI: torch.Tensor,
    w_LOI: torch.Tensor,
    tokens_per_expert,
    backend: str,
    fp8_recipe: str | None = None,
    index_limit: int | None = None,
    delayed=None,
    name: str = "",
    delay_wgrad: bool = False,
    device_sizes: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y_NO`` with ``y[rows of e] = x[rows of e] · w_LOI[e]ᵀ``; rows expert-major.

    ``tokens_per_expert``: list or 1-D integer tensor [E] on the inputs' device. ``backend`` is ``loop``,
    ``torch`` or ``emulated`` (``fp8_recipe`` required for ``emulated``; ``torch`` with ``rowwise`` or
    ``mxfp8`` runs FP8 through ``torch._scaled_grouped_mm``, reading the counts on the host and padding
    each expert's rows to the recipe's alignment unless they are already). Calls are chunked so that
    no operand of one call exceeds ``index_limit`` elements (default :data:`INDEX_LIMIT`, read at the
    call). The ``torch`` backend with a device tensor of counts runs without a host transfer however
    many calls it makes (and without checking that the counts sum to N): every call's offsets are cut
    from the counts on the device; with a list it copies them to the device once.
    ``delayed`` (a :class:`folding.quant.DelayedScaling`) and
    ``name`` give the ``delayed`` recipe its amax histories, keyed by ``(name, expert)``.
    ``delay_wgrad`` (``torch`` backend; ``parallel.delay_wgrad``): the weight gradient is computed
    while the next exchange of the backward is in flight (:class:`_GroupedMMDelayedWgrad`), bitwise
    the same, and delivered once per backward however many calls the GEMM is split into (the
    gradient reducer accepts one delivery per parameter); the other backends ignore it.
    ``device_sizes`` (``torch`` with an FP8 recipe): the list ``tokens_per_expert`` as an integer
    tensor on the device, from which the kernels' offsets are built there (see
    :func:`folding.moe.experts.scaled.scaled_grouped_linear`).
    """
    num_rows, num_experts = x_NI.shape[0], w_LOI.shape[0]
    if num_rows == 0 and num_experts > 0:
        # no tokens on this rank: a plain matmul keeps the graph (zero weight gradients) and avoids
        # grouped_mm's backward, which rejects the stride-0 gradient of an empty output
        return x_NI @ w_LOI[0].t()
    index_limit = INDEX_LIMIT if index_limit is None else index_limit
    width = max(x_NI.shape[1], w_LOI.shape[1])
    if backend == "torch" and fp8_recipe is None:
        if isinstance(tokens_per_expert, torch.Tensor):  # device counts: no host read, no check
            if tuple(tokens_per_expert.shape) != (num_experts,):
                shape = tuple(tokens_per_expert.shape)
                raise ValueError(f"tokens_per_expert shape {shape} must be [num_local_experts={num_experts}]")
            counts_L = tokens_per_expert
        else:  # host counts: validated, then one host→device copy for every call
            counts = host_counts(tokens_per_expert, num_experts, num_rows)
            counts_L = torch.tensor(counts, dtype=torch.int64).to(x_NI.device)
        rows = max(1, index_limit // (width + 16))  # the rows of plan_chunks' calls
        return _torch_calls(x_NI, w_LOI, counts_L, rows, delay_wgrad)
    counts = host_counts(tokens_per_expert, num_experts, num_rows)
    if backend == "torch":
        return _scaled_calls(x_NI, w_LOI, counts, fp8_recipe, index_limit, delay_wgrad, device_sizes)
    calls = plan_chunks(counts, width + 16, index_limit)
    if backend == "emulated":
        linear = functools.partial(_emulated_one, recipe=fp8_recipe, delayed=delayed, name=name)
    else:
        linear = _plain_one
    return _chunked_calls(x_NI, w_LOI, calls, backend, linear)


def _chunked_calls(x_NI, w_LOI, calls, backend: str, linear) -> torch.Tensor:
    """Run ``backend`` (``loop`` or ``emulated``) once per call of :func:`plan_chunks` (``calls``: lists of
    ``(expert, rows)``) over consecutive row ranges of ``x_NI``; the outputs concatenated."""
    if backend not in ("loop", "emulated"):
        raise ValueError(f"grouped_linear backend={backend!r} is not one of loop, torch, emulated")
    outs = []
    for call, xs in zip(calls, x_NI.split([sum(c for _, c in call) for call in calls])):
        outs.append(_loop_call(xs, w_LOI, [c for _, c in call], linear, [e for e, _ in call]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 0)


def _scaled_calls(x_NI, w_LOI, counts, recipe, index_limit, delay_wgrad, device_sizes=None):
    """FP8 grouped GEMMs in calls of whole aligned row blocks (an expert may span calls); every expert
    has at least one block (the kernel refuses empty groups). ``device_sizes``: ``counts`` on the
    device; each call's sizes are cut from it there (without it, and more than one call, ``counts``
    is copied to the device once). With ``delay_wgrad`` the calls' weight gradients are delivered
    once (:class:`~folding.overlap.wgrad.WeightGradPieces`)."""
    align = FP8_ROW_ALIGN.get(recipe, 16)
    if any(c % align or c == 0 for c in counts):  # standalone use: align once for every call
        x_NpI, padded = pad_rows_per_expert(x_NI, counts, align, min_rows=align)
        y_NpO = _scaled_calls(x_NpI, w_LOI, padded, recipe, index_limit, delay_wgrad)
        return unpad_rows_per_expert(y_NpO, counts, padded)
    width = max(x_NI.shape[1], w_LOI.shape[1]) + FEATURE_ALIGN.get(recipe, 16)
    rows = max(align, (index_limit // width) // align * align)  # every piece stays aligned
    calls = plan_chunks(counts, 1, rows)
    if len(calls) == 1:
        return scaled_grouped_linear(x_NI, w_LOI, counts, recipe, delay_wgrad, device_sizes)
    if device_sizes is None:  # standalone use: one copy for every call
        device_sizes = torch.tensor(counts, dtype=torch.int64).to(x_NI.device)
    ends_L = device_sizes.to(torch.int64).cumsum(0)
    pieces = wgrad.WeightGradPieces()  # one delivery of the weight gradient for all the calls
    outs, start = [], 0
    for call, xs in zip(calls, x_NI.split([sum(c for _, c in call) for call in calls])):
        n = xs.shape[0]
        experts = [e for e, _ in call]
        ws = w_LOI.narrow(0, experts[0], len(experts))
        # this call's pieces: every expert's end clipped to the call's rows
        ends = (ends_L[experts[0] : experts[-1] + 1] - start).clamp(0, n)
        sizes = torch.cat([ends[:1], ends[1:] - ends[:-1]])
        counts_c = [c for _, c in call]
        outs.append(scaled_grouped_linear(xs, ws, counts_c, recipe, delay_wgrad, sizes, wgrad_pieces=pieces))
        start += n
    return torch.cat(outs, 0)


def _plain_one(x_NeI, w_OI, expert):
    return x_NeI @ w_OI.t()


def _emulated_one(x_NeI, w_OI, expert, recipe, delayed, name):
    return emulated_linear(x_NeI, w_OI, recipe, delayed=delayed, key=(name, expert))
