"""FP8 experts on the ``torch`` backend: every expert GEMM through ``torch._scaled_grouped_mm``.

Shape suffixes (docs/shapes.md): N rows sorted expert-major (each expert's rows padded to the
recipe's alignment), L local experts, I input features, O output features; ``x_NI``, ``w_LOI``
(nn.Linear-style out×in), ``y_NO``.

**Which op, and why.** The engine calls the aten operator ``torch._scaled_grouped_mm(self, mat2,
scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False)``,
whose schema is the same in torch 2.11 (the GPU test machine) and 2.13. torchao's MoE training ops
wrap this operator but are not installed there and target other torch versions, and
``torch.nn.functional.scaled_grouped_mm`` exists only from torch 2.10 on; the aten operator is what
every supported torch runs. The quantization is :mod:`folding.quant`'s, the functions the
``emulated`` backend uses, so the two backends see the same FP8 operands.

**Recipes.** ``rowwise`` (compute capability 9.x; Hopper's CUTLASS kernel): e4m3 operands, each row
along the GEMM's contraction scaled by its own float32 power-of-two scale (as torchao rounds them),
bf16 output, float32 accumulation (``use_fast_accum=False``: Hopper's fast accumulation keeps partial
sums in lower precision). ``mxfp8`` (compute capability 10.x): see :mod:`folding.moe.experts.mxfp8`.
Forward, input gradient and weight gradient are all FP8, as torchao's FP8 grouped GEMM for MoE
training does (for ``y = x·wᵀ``):

- forward, 2-D × 3-D: ``mat_a = x [N, I]`` scaled per row, ``mat_b = wᵀ [L, I, O]`` scaled per output
  row of ``w``; scales ``[N]`` and ``[L, O]``;
- input gradient, 2-D × 3-D: ``dy [N, O]`` per row, ``w`` re-quantized along its other dimension
  (per input column, over O); scales ``[N]`` and ``[L, I]``;
- weight gradient, 2-D × 2-D grouped along tokens: ``dyᵀ [O, N]`` and ``x [N, I]`` both scaled per
  feature column over each expert's tokens (:func:`folding.quant.fp8.quantize_fp8_group_columns`);
  scales ``[L·O]`` and ``[L·I]`` group-major; output ``[L, O, I]``. ``x``'s codes and scales for it
  are made in the forward and are all the GEMM keeps of ``x`` (1 byte per element plus ``4·L·I`` bytes;
  MXFP8: one E8M0 byte per 32 tokens), as TransformerEngine keeps only its input's columnwise copy.

**Operand rules** (PyTorch's checks in ``aten/src/ATen/native/cuda/GroupedBlas.cpp`` and its tests):
``mat_a`` row-major, ``mat_b`` column-major (the transpose of a contiguous tensor); the last dimension
of ``mat_a`` and both of ``mat_b`` multiples of 16; ``offs`` the int32 cumulative group ends on the
device; float32 scales, 1-D and contiguous for a 2-D operand (``[M]``, or ``[G·M]`` in 2-D × 2-D),
``[G, N]`` for a 3-D one; bf16 output only; no bias, no ``scale_result``. Rows per expert are padded
to 16 (``rowwise``) / 32 (``mxfp8``) and features to 16 / 32 with zeros, which changes no scale.

**No empty group.** The 2-D × 2-D (weight-gradient) CUTLASS kernel asserts on a group of zero rows in
some torch builds ("CUTLASS cannot handle delta=0"), and a device-side assert leaves the CUDA context
unusable for the rest of the process. So every expert gets at least one aligned block of rows (zeros
for an expert without tokens, whose weight gradient is then exactly zero), as torchtitan pads with
``clamp_min(tokens_per_expert, alignment)``; the start-up probe passes no empty group either.

**No host copy.** ``offs`` must be on the device; a blocking copy from host memory is a stream
synchronization on CUDA. The MoE layer hands the dispatch record's device counts down, and the padded
sizes and offsets are computed from them on the device (:func:`aligned_sizes`); the host counts (known
from the dispatcher's one split-size read) only drive the split/cat padding and the MXFP8 scale layout.

Not run on a GPU yet: on CPU the kernel does not exist, and the tests drive this code through a
stand-in with the operator's schema (``tests/unit/test_experts_torch_fp8.py``).

Usage::

    y_NO = scaled_grouped_linear(x_NI, w_LOI, [32, 0, 16], "rowwise")   # bf16 in, bf16 out
    ok, why = scaled_grouped_mm_support("rowwise", torch.device("cuda", 0), torch.bfloat16)
"""

from __future__ import annotations

import functools

import torch

from folding.moe.experts import mxfp8 as expert_mxfp8
from folding.moe.experts.te import FP8_ROW_ALIGN, pad_rows_per_expert, unpad_rows_per_expert
from folding.overlap import wgrad
from folding.overlap.lanes import LaneError
from folding.quant.emulate import emulated_linear
from folding.quant.fp8 import quantize_fp8_group_columns, quantize_fp8_rowwise

E4M3 = torch.float8_e4m3fn
FAST_ACCUM = False
"""``use_fast_accum`` of the rowwise kernel: False keeps float32 accumulation."""

CAPABILITY = {"rowwise": 9, "mxfp8": 10}
"""Major compute capability whose kernel runs each recipe (sm_90: CUTLASS rowwise; sm_100: MXFP8)."""

FEATURE_ALIGN = {"rowwise": 16, "mxfp8": 32}
"""Multiple the feature dimensions are zero-padded to (16 for the kernel, 32 for MX blocks)."""


def scaled_mm_op():
    """``torch._scaled_grouped_mm`` of the running torch (looked up per call), or None."""
    return getattr(torch, "_scaled_grouped_mm", None)


def _rowwise_forward(x_NI, w_LOI, counts, offs_L, out_dtype):
    """``y = x·w[e]ᵀ``: x scaled per row, w per output row (both along the contraction I)."""
    xq_NI, xs_N1 = quantize_fp8_rowwise(x_NI.contiguous(), E4M3, power_2_scale=True)
    wq_LOI, ws_LO1 = quantize_fp8_rowwise(w_LOI.contiguous(), E4M3, power_2_scale=True)
    return scaled_mm_op()(
        xq_NI,
        wq_LOI.transpose(-2, -1),
        xs_N1.squeeze(-1),
        ws_LO1.squeeze(-1),
        offs=offs_L,
        out_dtype=out_dtype,
        use_fast_accum=FAST_ACCUM,
    )


def _rowwise_dgrad(dy_NO, w_LOI, counts, offs_L, out_dtype):
    """``dx = dy·w[e]``: the forward GEMM with w re-quantized along O (one scale per input column)."""
    return _rowwise_forward(dy_NO, w_LOI.transpose(-2, -1), counts, offs_L, out_dtype)


def _rowwise_wgrad_input(x_NI, counts_L, counts):
    """x as the weight gradient reads it, kept from the forward: e4m3 codes scaled per feature column over
    each expert's tokens, stored ``[I, N]`` row-major (the column-major operand), and the scales ``[L·I]``."""
    xq_NI, xs_LI = quantize_fp8_group_columns(x_NI, counts_L, E4M3, power_2_scale=True, host_counts=counts)
    return xq_NI.t().contiguous(), xs_LI.reshape(-1)


def _rowwise_wgrad(dy_NO, x_kept, counts_L, offs_L, out_dtype, counts):
    # both operands scaled per feature column over each expert's tokens (the contraction)
    xq_IN, xs = x_kept
    gq_NO, gs_LO = quantize_fp8_group_columns(dy_NO, counts_L, E4M3, power_2_scale=True, host_counts=counts)
    return scaled_mm_op()(
        gq_NO.t().contiguous(),  # [O, N] row-major
        xq_IN.t(),  # [N, I] column-major
        gs_LO.reshape(-1),
        xs,
        offs=offs_L,
        out_dtype=out_dtype,
        use_fast_accum=FAST_ACCUM,
    )


_OPS = {
    "rowwise": (_rowwise_forward, _rowwise_dgrad, _rowwise_wgrad_input, _rowwise_wgrad),
    "mxfp8": (expert_mxfp8.mx_forward, expert_mxfp8.mx_dgrad, expert_mxfp8.mx_wgrad_input, expert_mxfp8.mx_wgrad),
}
TORCH_FP8_RECIPES = tuple(_OPS)
"""FP8 recipes the ``torch`` backend runs."""


class _ScaledGroupedLinear(torch.autograd.Function):
    """``y = x·w[e]ᵀ`` per expert with FP8 forward, input-gradient and weight-gradient GEMMs.

    Keeps ``w`` (the input gradient re-quantizes it along its other dimension) and ``x`` only quantized as
    the weight gradient reads it (codes and scales along each expert's tokens, computed in the forward:
    TransformerEngine's columnwise copy), never the high-precision ``x``; the weight gradient is the one
    re-quantizing ``x`` in backward would give, bit for bit. With an ``anchor`` (``delay_wgrad``: the
    weight as the graph holds it, and the :class:`~folding.overlap.wgrad.WeightGradPieces` of its
    GEMM) the weight gradient is deferred to the next exchange wait and delivered to the anchor then,
    once for all the calls of a split GEMM.
    """

    @staticmethod
    def forward(ctx, x_NI, w_LOI, counts_L, offs_L, recipe, counts, anchor):
        ctx.recipe, ctx.counts, ctx.x_dtype = recipe, counts, x_NI.dtype
        ctx.anchor, ctx.pieces = anchor if anchor else (None, None)
        wants_wgrad = ctx.needs_input_grad[1] or (ctx.anchor is not None and ctx.anchor.requires_grad)
        x_kept = _OPS[recipe][2](x_NI, counts_L, counts) if wants_wgrad else (None, None)
        ctx.save_for_backward(*x_kept, w_LOI, counts_L, offs_L)
        return _OPS[recipe][0](x_NI, w_LOI, counts, offs_L, x_NI.dtype)

    @staticmethod
    def backward(ctx, g_NO):
        x_data, x_scale, w_LOI, counts_L, offs_L = ctx.saved_tensors
        _, dgrad, _, wgrad = _OPS[ctx.recipe]
        g_NO = g_NO.contiguous()
        gx = dgrad(g_NO, w_LOI, ctx.counts, offs_L, ctx.x_dtype) if ctx.needs_input_grad[0] else None

        def weight_grad():
            # every group has rows (padded to at least one aligned block): each output is defined
            return wgrad(g_NO, (x_data, x_scale), counts_L, offs_L, w_LOI.dtype, ctx.counts)

        gw = None
        if ctx.anchor is not None:
            if ctx.anchor.requires_grad:
                ctx.pieces.add(ctx.anchor, weight_grad)
        elif ctx.needs_input_grad[1]:
            gw = weight_grad()
        return gx, gw, None, None, None, None, None


def _pad_features(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    pad = (-t.shape[dim]) % multiple
    if pad == 0:
        return t
    spec = [0, 0] * (t.dim() - (dim % t.dim()) - 1) + [0, pad]
    return torch.nn.functional.pad(t, spec)


def aligned_sizes(counts_L: torch.Tensor, align: int) -> torch.Tensor:
    """Rows per expert after padding, on ``counts_L``'s device: each count rounded up to a multiple
    of ``align`` and at least ``align`` (what :func:`folding.moe.experts.te.pad_rows_per_expert` gives
    with ``min_rows=align``; torchtitan pads the same way, ``clamp_min(tokens_per_expert, alignment)``).
    No host copy."""
    return ((counts_L.to(torch.int64) + (align - 1)) // align * align).clamp_min(align)


def scaled_grouped_linear(
    x_NI: torch.Tensor,
    w_LOI: torch.Tensor,
    counts: list[int],
    recipe: str,
    delay_wgrad: bool = False,
    device_sizes: torch.Tensor | None = None,
    wgrad_pieces: wgrad.WeightGradPieces | None = None,
) -> torch.Tensor:
    """``y_NO`` with ``y[rows of e] = x[rows of e] · w_LOI[e]ᵀ`` in FP8 (``recipe``: ``rowwise`` or ``mxfp8``).

    ``x_NI`` bfloat16, rows sorted expert-major; ``counts``: host rows per expert (rows are padded
    per expert to the recipe's alignment, and every expert to at least one aligned block, here when
    they are not already, and the padding removed: the kernel's weight-gradient GEMM refuses a group
    of zero rows); ``w_LOI`` is cast to ``x_NI``'s dtype by the caller. ``device_sizes``: the padded
    ``counts`` as an integer tensor on the device (the engine derives it from the dispatch record's
    device counts, :func:`aligned_sizes`); the kernel's offsets are built from it there. Without it
    the sizes are copied from the host (one blocking copy on a GPU: standalone use only).
    ``delay_wgrad``: defer the weight gradient (see :class:`_ScaledGroupedLinear`); bitwise the same.
    ``wgrad_pieces``: the collector shared by the calls of one split GEMM, which then delivers their
    deferred weight gradients once (default: this call's own).
    """
    if recipe not in _OPS:
        raise ValueError(f"fp8_recipe={recipe!r}: the torch backend runs {TORCH_FP8_RECIPES} only")
    if x_NI.dtype != torch.bfloat16 or w_LOI.dtype != torch.bfloat16:
        raise ValueError(
            f"torch._scaled_grouped_mm returns bfloat16 only: the experts need bfloat16 activations and "
            f"weights (got {x_NI.dtype} and {w_LOI.dtype}); set train.precision=bf16"
        )
    if len(counts) != w_LOI.shape[0] or sum(counts) != x_NI.shape[0]:
        raise ValueError(f"counts={list(counts)} must have {w_LOI.shape[0]} entries summing to {x_NI.shape[0]}")
    rows = FP8_ROW_ALIGN[recipe]
    x_NpI, padded = pad_rows_per_expert(x_NI, list(counts), rows, min_rows=rows)
    if padded != list(counts):
        device_sizes = None  # padded here: the caller's sizes describe the unpadded rows
    align, out = FEATURE_ALIGN[recipe], w_LOI.shape[1]
    xp = _pad_features(x_NpI, 1, align)
    wp = _pad_features(_pad_features(w_LOI, 2, align), 1, align)
    if device_sizes is None:  # standalone use: one host copy
        device_sizes = torch.tensor(padded, dtype=torch.int32).to(x_NI.device)
    counts_L = device_sizes.to(torch.int32)
    offs_L = counts_L.cumsum(0, dtype=torch.int32)
    if delay_wgrad and wp.requires_grad and torch.is_grad_enabled():
        # the weight enters detached; its gradient reaches ``wp`` when the deferred work runs
        pieces = wgrad.WeightGradPieces() if wgrad_pieces is None else wgrad_pieces
        y = _ScaledGroupedLinear.apply(xp, wp.detach(), counts_L, offs_L, recipe, tuple(padded), [wp, pieces])
    else:
        y = _ScaledGroupedLinear.apply(xp, wp, counts_L, offs_L, recipe, tuple(padded), None)
    y = y[:, :out] if y.shape[1] != out else y
    return unpad_rows_per_expert(y, list(counts), padded)


def scaled_grouped_mm_support(recipe: str, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the ``torch`` backend runs FP8 ``recipe`` on ``device`` / ``dtype``; the reason when not.

    Needs ``torch._scaled_grouped_mm``, a CUDA GPU of the recipe's compute capability
    (:data:`CAPABILITY`), bfloat16 activations, and a tiny forward+backward that agrees with the
    ``emulated`` backend on that GPU (probed once per device and recipe).
    """
    device = torch.device(device)
    if recipe not in _OPS:
        return False, (
            f"the torch backend runs the FP8 recipes {', '.join(TORCH_FP8_RECIPES)} (torch._scaled_grouped_mm), "
            f"not {recipe!r}; TransformerEngine (te) or the CPU emulation (emulated) runs it"
        )
    if scaled_mm_op() is None:
        return False, f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    need = CAPABILITY[recipe]
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, (
            f"torch._scaled_grouped_mm runs {recipe} on CUDA GPUs of compute capability {need}.x only "
            "(no CUDA device here)"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if major != need:
        return False, (
            f"torch._scaled_grouped_mm runs {recipe} on compute capability {need}.x; this GPU is {major}.{minor}"
        )
    if dtype != torch.bfloat16:
        return False, f"torch._scaled_grouped_mm returns bfloat16 only; the experts compute in {dtype}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _probe(recipe, index)


@functools.lru_cache(maxsize=None)
def _probe(recipe: str, index: int) -> tuple[bool, str]:
    """One small FP8 forward+backward on ``cuda:index`` against the emulated backend."""
    try:
        # autograd whatever the caller's context, and no saved tensor reaching an enclosing activation
        # checkpoint (the first call may come from a recomputed region)
        with (
            torch.inference_mode(False),
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        ):
            return _run_probe(recipe, torch.device("cuda", index))
    except LaneError:  # run inside an overlap lane: not an answer about the kernel
        raise
    except Exception as exc:  # noqa: BLE001 - any failure means "cannot run here", with its reason
        return False, f"torch._scaled_grouped_mm failed on this GPU ({type(exc).__name__}: {exc})"


def _run_probe(recipe: str, device: torch.device) -> tuple[bool, str]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    counts = [32, 8, 56]  # no empty group (the weight-gradient kernel may assert on one), one unaligned
    x = torch.randn(96, 64, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(3, 32, 64, generator=gen).to(device, torch.bfloat16)
    g = torch.randn(96, 32, generator=gen).to(device, torch.bfloat16)
    got, want = [], []
    for fn, out in ((None, got), (emulated_linear, want)):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        if fn is None:
            y = scaled_grouped_linear(xx, ww, counts, recipe)
        else:
            parts = [fn(xe, ww[e], recipe) for e, xe in enumerate(xx.split(counts)) if counts[e]]
            y = torch.cat(parts)
        y.backward(g)
        out += [y.float(), xx.grad.float(), ww.grad.float()]
    for name, a, b in zip(("output", "input gradient", "weight gradient"), got, want):
        err = float((a - b).norm() / b.norm().clamp_min(1e-30))
        if not err < 2e-2:
            return False, f"torch._scaled_grouped_mm {recipe} {name} differs from the emulation by {err:.3g} (relative)"
    return True, ""
