"""FP8 on the ``torch`` backend on CPU, through a stand-in for ``torch._scaled_grouped_mm``.

The stand-in (``tests/scaled_grouped_mm_standin.py``) runs torch's own checks of the operator (its
meta kernel on ``meta`` copies of the operands), the group alignment the kernels need, and the
reference numerics.

Checked here: the stand-in's signature against the installed torch's schema, and each of torch's
rules it enforces refusing a bad call (16-byte strides, contiguous scales, MXFP8 scale shapes);
``rowwise`` on the ``emulated`` backend bit for bit against a reference built by hand;
the ``torch`` FP8 path through the stand-in bit for bit against ``emulated`` (output and every
gradient, delayed weight gradients too), an expert without tokens padded to one block of rows (the
stand-in refuses an empty group in the weight-gradient call, as the CUTLASS kernel asserts), the
kernels' sizes cut from device counts in every chunk; the MXFP8 scale layout. Backend × recipe selection and the
job's machine check: ``test_expert_choice_fp8.py``. The real kernels are not run here (no GPU).
"""

import pytest
import torch

import folding.moe.experts.select as select_mod
from folding.moe.experts.backends import grouped_linear
from folding.moe.experts.grouped import GroupedMLP
from folding.moe.experts.mxfp8 import to_blocked
from folding.moe.experts.scaled import aligned_sizes
from folding.overlap.runtime import OverlapRuntime
from tests.scaled_grouped_mm_standin import (
    CALLS,
    E8M0,
    SCHEMA,
    bind_to_schema,
    blocked_offsets,
    recording_stand_in,
    scaled_grouped_mm,
    schema_params,
    signature_params,
    unblock,
    up,
)


@pytest.fixture
def stand_in_kernel(monkeypatch):
    """The stand-in as ``torch._scaled_grouped_mm``, and the torch FP8 path allowed on this CPU."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", recording_stand_in)
    monkeypatch.setattr(select_mod, "scaled_grouped_mm_support", lambda recipe, device, dtype: (True, ""))
    CALLS.clear()
    yield


def test_stand_in_takes_the_installed_operators_arguments():
    assert [a.name for a in SCHEMA.arguments][:4] == ["self", "mat2", "scale_a", "scale_b"]
    assert signature_params(scaled_grouped_mm) == schema_params()

    def drifted(self, mat2, scale_a, scale_b, offs=None, bias=None, scale_result=None, output_dtype=None):
        pass

    assert signature_params(drifted) != schema_params()  # a drifted stand-in fails the check above
    with pytest.raises(AssertionError, match="output_dtype"):
        bind_to_schema((1, 2, 3, 4), {"output_dtype": torch.bfloat16})


# ------------------------------------------------------------- torch's own checks, one per rule
F8 = torch.float8_e4m3fn


def _fp8(rows, cols, gen):
    return torch.randn(rows, cols, generator=gen).to(F8)


def test_meta_kernel_of_the_operator_is_registered_on_this_cpu_build():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::_scaled_grouped_mm", "Meta")


def test_stand_in_refuses_a_stride_not_a_multiple_of_16_bytes():
    gen = torch.Generator().manual_seed(0)
    b = _fp8(2 * 16, 32, gen).view(2, 16, 32).transpose(-2, -1)  # [G, K, N] column-major
    sa, sb, offs = torch.ones(32), torch.ones(2, 16), torch.tensor([16, 32], dtype=torch.int32)
    a_bad = _fp8(32, 40, gen)[:, :32]  # 32 columns, rows 40 bytes apart
    with pytest.raises(RuntimeError, match="Expected mat_a stride along 0 dim to be multiple of 16 bytes, got 40"):
        scaled_grouped_mm(a_bad, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)
    y = scaled_grouped_mm(a_bad.contiguous(), b, sa, sb, offs=offs, out_dtype=torch.bfloat16)
    assert y.shape == (32, 16)


def test_stand_in_refuses_a_non_contiguous_scale():
    gen = torch.Generator().manual_seed(0)
    a, b = _fp8(16, 32, gen), _fp8(16, 32, gen).t()  # 2-D x 2-D: groups along the 32 contraction rows
    offs, sa = torch.tensor([16, 32], dtype=torch.int32), torch.ones(2 * 16)
    sb_bad = torch.ones(2 * 2 * 16)[::2]  # the right 32 elements, every other one of a buffer
    with pytest.raises(RuntimeError, match="Expected scale_b to be contiguous"):
        scaled_grouped_mm(a, b, sa, sb_bad, offs=offs, out_dtype=torch.bfloat16)
    y = scaled_grouped_mm(a, b, sa, sb_bad.contiguous(), offs=offs, out_dtype=torch.bfloat16)
    assert y.shape == (2, 16, 16)


def test_stand_in_refuses_an_empty_group_in_the_weight_gradient_call():
    # 2-D x 2-D groups along the contraction: [O, N] x [N, I] with N = 16 + 0 + 16
    gen = torch.Generator().manual_seed(0)
    a, b = _fp8(16, 32, gen), _fp8(16, 32, gen).t()  # a [16, 32] row-major, b [32, 16] column-major
    s_a, s_b = torch.ones(3 * 16), torch.ones(3 * 16)
    with pytest.raises(AssertionError, match="CUTLASS cannot handle delta=0"):
        scaled_grouped_mm(a, b, s_a, s_b, offs=torch.tensor([16, 16, 32], dtype=torch.int32))
    y = scaled_grouped_mm(a, b, s_a[:32], s_b[:32], offs=torch.tensor([16, 32], dtype=torch.int32))
    assert y.shape == (2, 16, 16) and not y.isnan().any()


def test_stand_in_refuses_mxfp8_scales_of_the_wrong_shape():
    gen = torch.Generator().manual_seed(0)
    one = 127  # E8M0 byte of 2^0
    # 2-D x 3-D: the 3-D operand's scales are [G, blocked size]: 128-row tiles of 4 scale columns
    a, b = _fp8(64, 64, gen), _fp8(2 * 32, 64, gen).view(2, 32, 64).transpose(-2, -1)  # K=64, N=32
    offs = torch.tensor([32, 64], dtype=torch.int32)
    sa = torch.full((2 * 128, 4), one, dtype=torch.uint8).view(E8M0)  # per group: 128 rows x up(64/32, 4)
    blocked = up(32, 128) * up(64 // 32, 4)
    sb_bad = torch.full((2, blocked // 2), one, dtype=torch.uint8).view(E8M0)
    with pytest.raises(
        RuntimeError,
        match=r"For MXFP8, expected mat.shape=.* to have scale shape of \(2,512.*got torch.Size\(\[2, 256\]\)",
    ):
        scaled_grouped_mm(a, b, sa, sb_bad, offs=offs, out_dtype=torch.bfloat16)
    sb = torch.full((2, blocked), one, dtype=torch.uint8).view(E8M0)
    assert scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16).shape == (64, 32)
    # 2-D x 2-D: the scales of a 2-D operand are 2-D (the blocked bytes of each group, stacked)
    a2, b2 = _fp8(32, 64, gen), _fp8(32, 64, gen).t()  # M=32, N=32, groups of 32 contraction rows
    flat = torch.full((2 * 128 * 4,), one, dtype=torch.uint8).view(E8M0)
    with pytest.raises(RuntimeError, match="For MXFP8, scale must have same number of dimensions as target tensor"):
        scaled_grouped_mm(a2, b2, flat, flat.view(-1, 4), offs=offs, out_dtype=torch.bfloat16)
    y = scaled_grouped_mm(a2, b2, flat.view(-1, 4), flat.view(-1, 4), offs=offs, out_dtype=torch.bfloat16)
    assert y.shape == (2, 32, 32)


# --------------------------------------------------------------------- rowwise on the emulated backend
def _hand_quant(t, dim):
    """Hand-built rowwise FP8 along ``dim``: power-of-two scale 2^floor(log2(448/amax)) from the
    binary exponent, e4m3 round-to-nearest with saturation, dequantized in float32."""
    tf = t.float()
    amax = tf.abs().amax(dim=dim, keepdim=True)
    _, exp = torch.frexp(448.0 / torch.where(amax > 0, amax, torch.ones_like(amax)))
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), exp - 1), torch.ones_like(amax))
    q = (tf * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (q.float() / scale).to(t.dtype).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rowwise_emulated_matches_a_hand_built_reference_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(3)
    counts = [7, 0, 33, 12]
    x = (torch.randn(52, 40, generator=gen) * torch.exp2(torch.randint(-6, 6, (52, 1), generator=gen))).to(dtype)
    w = torch.randn(4, 24, 40, generator=gen).to(dtype)
    dy = torch.randn(52, 24, generator=gen).to(dtype)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_linear(xx, ww, counts, "emulated", "rowwise")
    y.backward(dy)
    want_y, want_dx, want_dw = [], [], torch.zeros(4, 24, 40, dtype=dtype)
    for e, (xe, ge) in enumerate(zip(x.split(counts), dy.split(counts))):
        if not counts[e]:
            continue
        want_y.append((_hand_quant(xe, 1) @ _hand_quant(w[e], 1).t()).to(dtype))  # contraction: features
        want_dx.append((_hand_quant(ge, 1) @ _hand_quant(w[e], 0)).to(dtype))  # contraction: O
        want_dw[e] = (_hand_quant(ge, 0).t() @ _hand_quant(xe, 0)).to(dtype)  # contraction: tokens
    assert torch.equal(y, torch.cat(want_y))
    assert torch.equal(xx.grad, torch.cat(want_dx))
    assert torch.equal(ww.grad, want_dw)
    exact = torch.cat([xe.float() @ w[e].float().t() for e, xe in enumerate(x.split(counts))])
    rel = float((y.detach().float() - exact).norm() / exact.norm())
    assert 1e-3 < rel < 0.1  # FP8, not high precision


# ------------------------------------------------------------------- the torch path against emulated
KW = dict(num_local_experts=4, hidden_size=24, ffn_hidden_size=20, init_seed=2, init_std=0.3)


def _run(mod, x, counts, probs, dy):
    xx, pp = x.clone().requires_grad_(), probs.clone().requires_grad_()
    runtime = OverlapRuntime()
    with runtime.active():  # delayed weight gradients deferred onto it
        y = mod(xx, counts, pp)
        y.backward(dy)
        runtime.flush_deferred()
    return [y, xx.grad, pp.grad, mod.fc1_weight.grad, mod.fc2_weight.grad]


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
@pytest.mark.parametrize("delay_wgrad", [False, True])
def test_torch_fp8_path_matches_emulated_bit_for_bit(stand_in_kernel, recipe, delay_wgrad):
    gen = torch.Generator().manual_seed(1)
    counts = [5, 0, 40, 18]  # unaligned, an empty expert; H=24 and 2F=40 are not multiples of 16
    n = sum(counts)
    x = torch.randn(n, 24, generator=gen).to(torch.bfloat16)
    probs, dy = torch.rand(n, generator=gen), torch.randn(n, 24, generator=gen).to(torch.bfloat16)
    fast = GroupedMLP(backend="torch", fp8_recipe=recipe, params_dtype=torch.bfloat16, delay_wgrad=delay_wgrad, **KW)
    emu = GroupedMLP(backend="emulated", fp8_recipe=recipe, params_dtype=torch.bfloat16, **KW)
    got, want = _run(fast, x, counts, probs, dy), _run(emu, x, counts, probs, dy)
    for name, a, b in zip(("y", "dx", "dprobs", "dW1", "dW2"), got, want):
        assert torch.equal(a, b), name
    # fc1 and fc2, each forward + input gradient + weight gradient: 6 kernel calls, all FP8
    assert len(CALLS) == 6 and all(c["mx"] == (recipe == "mxfp8") for c in CALLS)
    assert [len(c["b"]) for c in CALLS].count(2) == 2  # the two weight gradients are 2-D x 2-D
    assert not any(c["fast"] for c in CALLS)  # float32 accumulation
    align = 16 if recipe == "rowwise" else 32
    padded = [max(up(c, align), align) for c in counts]  # the empty expert gets one block of zero rows
    assert {c["a"][0] for c in CALLS if len(c["b"]) == 3} == {sum(padded)}
    assert all(c["groups"] == padded for c in CALLS)  # no call sees an empty group


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_device_sizes_give_the_host_copy_result_in_every_chunk(stand_in_kernel, recipe):
    # counts already padded (the MoE layer pads once); a small index limit splits them into calls,
    # each cutting its sizes from the device tensor; an expert spans two calls
    align = 16 if recipe == "rowwise" else 32
    counts = [align, 3 * align, align, 2 * align]
    assert aligned_sizes(torch.tensor([0, 3 * align - 5, 1, 2 * align]), align).tolist() == counts
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(sum(counts), 32, generator=gen).to(torch.bfloat16)
    w = torch.randn(4, 32, 32, generator=gen).to(torch.bfloat16)
    limit = 2 * align * (32 + 32)  # two blocks of rows per call (width 32 plus the feature padding)
    outs, groups = [], []
    for sizes in (None, torch.tensor(counts)):
        CALLS.clear()
        outs.append(grouped_linear(x, w, counts, "torch", recipe, index_limit=limit, device_sizes=sizes))
        groups.append([c["groups"] for c in CALLS])
    assert torch.equal(outs[0], outs[1]) and groups[0] == groups[1]
    assert groups[1] == [[align, align], [2 * align], [align, align], [align]]  # expert 3 spans calls 3, 4


def test_torch_fp8_path_handles_no_rows_and_refuses_fp32(stand_in_kernel):
    mod = GroupedMLP(backend="torch", fp8_recipe="rowwise", params_dtype=torch.bfloat16, **KW)
    x = torch.zeros(0, 24, dtype=torch.bfloat16, requires_grad=True)
    y = mod(x, [0, 0, 0, 0], torch.zeros(0))
    y.sum().backward()
    assert y.shape == (0, 24) and mod.fc1_weight.grad is not None
    with pytest.raises(ValueError, match="bfloat16"):
        GroupedMLP(backend="torch", fp8_recipe="rowwise", **KW)(torch.randn(16, 24), [16, 0, 0, 0], torch.rand(16))


def test_blocked_layout_matches_the_tile_formula():
    scales = torch.randint(0, 255, (200, 7), dtype=torch.uint8)
    flat = to_blocked(scales)
    assert flat.numel() == 256 * 8
    assert torch.equal(unblock(flat, 200, 7), scales)
    padding = torch.ones(flat.numel(), dtype=torch.bool)
    padding[blocked_offsets(200, 7).reshape(-1)] = False
    assert int(padding.sum()) == 256 * 8 - 200 * 7 and not flat[padding].any()  # padding is zero
