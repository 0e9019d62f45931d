"""FP8 on the ``torch`` backend on CPU, through a stand-in for ``torch._scaled_grouped_mm``.

The kernel runs only on CUDA (compute capability 9.0 rowwise, 10.0 MXFP8). The stand-in takes the
operator's arguments exactly: its signature is checked against the installed torch's schema
(``aten::_scaled_grouped_mm``: names, order, defaults), every call the engine makes is bound to that
schema, and it applies the CUDA operator's operand checks (row-major ``mat_a``, column-major
``mat_b``, dimensions multiple of 16, int32 offsets, float32 or E8M0 scales of the documented shapes,
bf16 output) plus the group alignment the kernels need, then computes the reference numerics:
dequantize, fp32 matmul per group, cast. MXFP8 scales are decoded from the blocked layout with the
tile formula of cuBLAS's documentation, written independently of the engine's permute.

Checked here: ``rowwise`` on the ``emulated`` backend bit for bit against a reference built by hand;
the ``torch`` FP8 path through the stand-in bit for bit against ``emulated`` (output and every
gradient, delayed weight gradients too); the MXFP8 scale layout. Backend × recipe selection and the
job's machine check: ``test_expert_choice_fp8.py``. The real kernels are not run here (no GPU).
"""

import inspect

import pytest
import torch

import folding.moe.expert_select as select_mod
from folding.moe.expert_backends import grouped_linear
from folding.moe.expert_mxfp8 import to_blocked
from folding.moe.experts import GroupedMLP
from folding.parallel import overlap

SCHEMA = torch._C._jit_get_schemas_for_operator("aten::_scaled_grouped_mm")[0]
E8M0 = torch.float8_e8m0fnu
CALLS = []


def _up(x, m):
    return -(-x // m) * m


def _offsets(rows, cols):
    """Where cuBLAS's blocked layout keeps the scale of (r, c): 128×4 tiles of 512 bytes, row tiles
    outer; inside a tile at byte (r % 32)·16 + (r // 32)·4 + c."""
    r = torch.arange(rows).view(-1, 1)
    c = torch.arange(cols).view(1, -1)
    tile = (r // 128) * (_up(cols, 4) // 4) + c // 4
    return tile * 512 + (r % 128 % 32) * 16 + (r % 128 // 32) * 4 + c % 4


def _unblock(flat_u8, rows, cols):
    """``[rows, cols]`` scales from the blocked layout."""
    return flat_u8.reshape(-1)[_offsets(rows, cols)]


def _mx_dequant(data_RK, scales_RB):
    """MXFP8 operand ``[R, K]`` with its ``[R, K/32]`` E8M0 bytes, as float32."""
    s = torch.exp2(scales_RB.to(torch.int32).float() - 127).repeat_interleave(32, dim=1)
    return data_RK.float() * s


def _scaled_grouped_mm(
    self, mat2, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False
):
    """CPU stand-in for ``torch._scaled_grouped_mm`` (2-D × 3-D and 2-D × 2-D with offsets)."""
    a, b = self, mat2
    CALLS.append(dict(a=tuple(a.shape), b=tuple(b.shape), fast=use_fast_accum, mx=scale_a.dtype == E8M0))
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
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    align = 32 if mx else 16  # the per-group row alignment the kernels need (what torchao pads to)
    assert all(e >= s and (e - s) % align == 0 for s, e in zip(starts, ends)), ends
    out_dtype = out_dtype or torch.bfloat16
    if b.dim() == 3:  # groups along a's rows; b[g] is [K, N]
        g_n, k, n = b.shape
        assert len(ends) == g_n and ends[-1] <= a.shape[0] and a.shape[1] == k
        out = torch.full((a.shape[0], n), float("nan"))  # rows past the last group: undefined
        if mx:
            assert scale_a.dim() == 2 and scale_b.shape == (g_n, _up(n, 128) * _up(k // 32, 4))
        else:
            assert scale_a.shape == (a.shape[0],) and scale_a.is_contiguous()
            assert scale_b.shape == (g_n, n) and scale_b.stride(1) == 1
        at = 0
        for g, (s, e) in enumerate(zip(starts, ends)):
            if mx:
                size = _up(e - s, 128) * _up(k // 32, 4)
                sa = _unblock(scale_a.view(torch.uint8).reshape(-1)[at : at + size], e - s, k // 32)
                at += size if e > s else 0
                ag = _mx_dequant(a[s:e], sa)
                bg = _mx_dequant(b[g].t(), _unblock(scale_b[g].view(torch.uint8), n, k // 32)).t()
            else:
                ag = a[s:e].float() * scale_a[s:e, None]
                bg = b[g].float() * scale_b[g][None, :]
            out[s:e] = ag @ bg
        return out.to(out_dtype)
    m, n = a.shape[0], b.shape[1]  # 2-D x 2-D: groups along the contraction
    assert ends[-1] == a.shape[1] == b.shape[0]
    out = torch.full((len(ends), m, n), float("nan"))  # an empty group's output is undefined
    if not mx:
        assert scale_a.shape == (len(ends) * m,) and scale_b.shape == (len(ends) * n,)
    at_a = at_b = 0
    for g, (s, e) in enumerate(zip(starts, ends)):
        if e == s:
            continue
        if mx:
            kb = (e - s) // 32
            size_a, size_b = _up(m, 128) * _up(kb, 4), _up(n, 128) * _up(kb, 4)
            sa = _unblock(scale_a.view(torch.uint8).reshape(-1)[at_a : at_a + size_a], m, kb)
            sb = _unblock(scale_b.view(torch.uint8).reshape(-1)[at_b : at_b + size_b], n, kb)
            at_a, at_b = at_a + size_a, at_b + size_b
            ag, bg = _mx_dequant(a[:, s:e], sa), _mx_dequant(b[s:e].t(), sb).t()
        else:
            ag = a[:, s:e].float() * scale_a[g * m : (g + 1) * m, None]
            bg = b[s:e].float() * scale_b[g * n : (g + 1) * n][None, :]
        out[g] = ag @ bg
    return out.to(out_dtype)


def _schema_params():
    return [(x.name, x.default_value if x.has_default_value() else inspect.Parameter.empty) for x in SCHEMA.arguments]


def _signature_params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def _bind_to_schema(args, kwargs):
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


def _recording_stand_in(*args, **kwargs):
    _bind_to_schema(args, kwargs)
    return _scaled_grouped_mm(*args, **kwargs)


@pytest.fixture
def stand_in_kernel(monkeypatch):
    """The stand-in as ``torch._scaled_grouped_mm``, and the torch FP8 path allowed on this CPU."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _recording_stand_in)
    monkeypatch.setattr(select_mod, "scaled_grouped_mm_support", lambda recipe, device, dtype: (True, ""))
    CALLS.clear()
    yield


def test_stand_in_takes_the_installed_operators_arguments():
    assert [a.name for a in SCHEMA.arguments][:4] == ["self", "mat2", "scale_a", "scale_b"]
    assert _signature_params(_scaled_grouped_mm) == _schema_params()

    def drifted(self, mat2, scale_a, scale_b, offs=None, bias=None, scale_result=None, output_dtype=None):
        pass

    assert _signature_params(drifted) != _schema_params()  # a drifted stand-in fails the check above
    with pytest.raises(AssertionError, match="output_dtype"):
        _bind_to_schema((1, 2, 3, 4), {"output_dtype": torch.bfloat16})


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
    y = mod(xx, counts, pp)
    y.backward(dy)
    overlap.flush_deferred()
    return [y, xx.grad, pp.grad, mod.fc1_weight.grad, mod.fc2_weight.grad]


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
@pytest.mark.parametrize("delay_wgrad", [False, True])
def test_torch_fp8_path_matches_emulated_bit_for_bit(stand_in_kernel, recipe, delay_wgrad):
    gen = torch.Generator().manual_seed(1)
    counts = [5, 0, 40, 18]  # unaligned, an empty expert; H=24 and 2F=40 are not multiples of 16
    n = sum(counts)
    x = torch.randn(n, 24, generator=gen).to(torch.bfloat16)
    probs, dy = torch.rand(n, generator=gen), torch.randn(n, 24, generator=gen).to(torch.bfloat16)
    fast = GroupedMLP(backend="torch", fp8_recipe=recipe, params_dtype=torch.bfloat16, **KW)
    fast.delay_wgrad = delay_wgrad
    emu = GroupedMLP(backend="emulated", fp8_recipe=recipe, params_dtype=torch.bfloat16, **KW)
    got, want = _run(fast, x, counts, probs, dy), _run(emu, x, counts, probs, dy)
    for name, a, b in zip(("y", "dx", "dprobs", "dW1", "dW2"), got, want):
        assert torch.equal(a, b), name
    # fc1 and fc2, each forward + input gradient + weight gradient: 6 kernel calls, all FP8
    assert len(CALLS) == 6 and all(c["mx"] == (recipe == "mxfp8") for c in CALLS)
    assert [len(c["b"]) for c in CALLS].count(2) == 2  # the two weight gradients are 2-D x 2-D
    assert not any(c["fast"] for c in CALLS)  # float32 accumulation
    align = 16 if recipe == "rowwise" else 32
    assert {c["a"][0] for c in CALLS if len(c["b"]) == 3} == {sum(_up(c, align) for c in counts)}


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
    assert torch.equal(_unblock(flat, 200, 7), scales)
    padding = torch.ones(flat.numel(), dtype=torch.bool)
    padding[_offsets(200, 7).reshape(-1)] = False
    assert int(padding.sum()) == 256 * 8 - 200 * 7 and not flat[padding].any()  # padding is zero
