"""FP8 per-tensor / per-row / blockwise scaling, fake quantization and the emulated FP8 linear."""

import pytest
import torch

from folding.quant import (
    RECIPES,
    cast_to_fp8,
    dequantize,
    emulated_linear,
    fake_quant,
    quant_dequant,
    quantize_fp8_blockwise,
    quantize_fp8_rowwise,
    quantize_fp8_tensorwise,
    quantize_mxfp8,
)

REL = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}  # half an ulp, relative
SUB = {torch.float8_e4m3fn: 2.0**-10, torch.float8_e5m2: 2.0**-17}  # half the smallest subnormal
MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _wide(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-8, 8, shape[:-1] + (1,), generator=g).float())


def test_cast_saturates_and_keeps_nan():
    x = torch.tensor([1e5, -1e6, float("nan"), float("inf"), 1.0, 1000.0])
    e4 = cast_to_fp8(x, torch.float8_e4m3fn).float()
    assert e4[:2].tolist() == [448.0, -448.0] and e4[2].isnan() and e4[3].isnan() and e4[4] == 1
    assert e4[5] == 448.0
    e5 = cast_to_fp8(x, torch.float8_e5m2).float()
    assert e5[:2].tolist() == [57344.0, -57344.0] and e5[2].isnan() and e5[3] == float("inf")
    assert e5[5] == 1024.0  # in range for e5m2: rounded (1000 -> 1024), not saturated
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        cast_to_fp8(x, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_rowwise_round_trip_and_zero_rows(dtype):
    x = _wide((5, 3, 40), 0)
    x[1, 2] = 0.0
    data, s_inv = quantize_fp8_rowwise(x, dtype)
    assert data.dtype == dtype and data.shape == x.shape
    assert s_inv.dtype == torch.float32 and s_inv.shape == (5, 3, 1)
    y = dequantize(data, s_inv)
    assert torch.equal(y, data.float() * s_inv)
    amax = x.abs().amax(-1, keepdim=True)
    assert torch.allclose(data.float().abs().amax(-1, keepdim=True)[amax > 0], torch.tensor(MAX[dtype]))
    bound = x.abs() * REL[dtype] + SUB[dtype] * s_inv
    assert bool(((y - x).abs() <= bound).all())
    assert s_inv[1, 2].item() == 1.0 and bool((y[1, 2] == 0).all())


def test_tensorwise_one_scale_and_power_of_two_option():
    x = _wide((7, 33), 1)
    data, s_inv = quantize_fp8_tensorwise(x)
    assert s_inv.dim() == 0 and data.float().abs().max().item() == 448.0
    y = dequantize(data, s_inv)
    assert bool(((y - x).abs() <= x.abs() * 2.0**-4 + 2.0**-10 * s_inv).all())
    d2, s2 = quantize_fp8_tensorwise(x, power_2_scale=True)
    assert torch.log2(s2).frac().item() == 0.0
    assert 224 <= d2.float().abs().max().item() <= 448
    z, zs = quantize_fp8_tensorwise(torch.zeros(3, 4))
    assert zs.item() == 1.0 and bool((z.float() == 0).all())


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_blockwise_partial_blocks(block):
    x = _wide((200, 300), 2)
    x[130:] *= 1000.0  # second block row much larger: separate 128x128 scales must not mix
    data, s_inv = quantize_fp8_blockwise(x, block)
    nb = (-(-200 // block[0]), -(-300 // block[1]))
    assert data.shape == x.shape and s_inv.shape == nb
    y = dequantize(data, s_inv, block=block)
    s_full = s_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:200, :300]
    assert bool(((y - x).abs() <= x.abs() * 2.0**-4 + 2.0**-10 * s_full).all())
    assert bool((torch.log2(s_inv).frac() == 0).all())  # power-of-two scales by default
    # every block uses the top binade: no block is quantized against a neighbour's amax
    xb = torch.nn.functional.pad(data.float().abs(), (0, nb[1] * block[1] - 300, 0, nb[0] * block[0] - 200))
    blk_max = xb.reshape(nb[0], block[0], nb[1], block[1]).amax((1, 3))
    assert bool((blk_max >= 224).all()) and bool((blk_max <= 448).all())


def test_non_finite_groups_decode_to_nan():
    x = torch.ones(3, 8)
    x[1, 2] = float("inf")
    data, s_inv = quantize_fp8_rowwise(x)
    y = dequantize(data, s_inv)
    assert bool(y[1].isnan().all()) and torch.equal(y[0], x[0]) and torch.equal(y[2], x[2])


@pytest.mark.parametrize("recipe", RECIPES)
def test_fake_quant_is_straight_through_and_matches_its_format(recipe):
    x = _wide((16, 256), 3).requires_grad_()
    y = fake_quant(x, recipe)
    assert not torch.equal(y, x) and torch.allclose(y, x, rtol=0.07, atol=1e-3)
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(x.grad, g)
    if recipe == "mxfp8":
        d, s = quantize_mxfp8(x.detach(), scale_mode="rceil")
        assert torch.equal(y.detach(), dequantize(d, s, block=(1, 32)))
    if recipe == "blockwise":
        d, s = quantize_fp8_blockwise(x.detach(), (1, 128))
        assert torch.equal(y.detach(), dequantize(d, s, block=(1, 128)))
    with pytest.raises(ValueError, match="fp8 recipe"):
        fake_quant(x, "fp4")


@pytest.mark.parametrize("recipe", RECIPES)
def test_emulated_linear_quantizes_each_gemm_along_its_contraction(recipe):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(48, 64, generator=g, requires_grad=True)
    w = torch.randn(40, 64, generator=g, requires_grad=True)
    dy = torch.randn(48, 40, generator=g)
    y = emulated_linear(x, w, recipe)
    y.backward(dy)
    qd = quant_dequant
    assert torch.equal(y, qd(x, recipe, "input", -1) @ qd(w, recipe, "weight", -1).t())
    assert torch.equal(x.grad, qd(dy, recipe, "grad", -1) @ qd(w, recipe, "weight", 0))
    assert torch.equal(w.grad, qd(dy, recipe, "grad", 0).t() @ qd(x, recipe, "input", 0))
    exact = x.detach() @ w.detach().t()
    rel = ((y - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 0.1
    if recipe in ("mxfp8", "blockwise", "rowwise"):  # wgrad operands are scaled along tokens, not features
        xw = _wide((128, 128), 9)  # rows of very different magnitudes: the two blockings differ
        assert not torch.equal(qd(xw, recipe, "input", 0), qd(xw, recipe, "input", -1))


def test_subnormal_amax_gives_finite_scales():
    x = torch.tensor([[1e-45, 0.0], [1e-40, -1e-41]])
    for pow2 in (False, True):
        d, s = quantize_fp8_rowwise(x, power_2_scale=pow2)
        y = dequantize(d, s)
        assert bool(torch.isfinite(y).all()) and bool(((y - x).abs() <= x.abs()).all())


def test_power_of_two_scales_never_saturate_at_the_boundary():
    # 448 / amax one ulp below a power of two: torch.log2 rounds it up to the exact exponent, and a
    # scale one octave too large pushes the row's largest value past 448 (it would saturate)
    amax = torch.tensor(56.0).nextafter(torch.tensor(64.0))  # 448 / amax = 8 - 2^-21, just below 8
    assert float(torch.floor(torch.log2(torch.tensor(448.0) / amax))) == 3.0  # the rounding trap
    x = torch.stack([amax, torch.tensor(1.0)]).reshape(1, 2)
    data, s_inv = quantize_fp8_rowwise(x, power_2_scale=True)
    assert float(s_inv) == 0.25  # scale 4, not 8
    assert float(data.float().abs().max()) < 448.0


def test_group_columns_are_each_groups_rowwise_transpose_bit_for_bit():
    from folding.quant.fp8 import quantize_fp8_group_columns

    x = _wide((48, 24), 7).t().contiguous().t()  # rows of very different magnitudes, any layout
    counts = [16, 0, 5, 27]
    for pow2 in (False, True):
        data, s_inv = quantize_fp8_group_columns(x, torch.tensor(counts), power_2_scale=pow2)
        assert data.shape == x.shape and s_inv.shape == (4, 24)
        for g, rows in enumerate(x.split(counts)):
            want_d, want_s = quantize_fp8_rowwise(rows.t(), power_2_scale=pow2)
            got = data.split(counts)[g].t()
            assert torch.equal(got.view(torch.uint8), want_d.view(torch.uint8))
            assert torch.equal(s_inv[g], want_s.squeeze(-1) if counts[g] else torch.ones(24))
