"""MXFP8 properties, and bit-exact agreement with a reference written from the OCP MX v1.0 text."""

import math

import numpy as np
import pytest
import torch

from folding.quant import dequantize, quantize_mxfp8

# ---- independent reference, from the spec --------------------------------------------------------
# e4m3 (OCP "E4M3FN"): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal
# (m/8 * 2^-6); S.1111.111 is NaN; no infinities; max normal 1.75 * 2^8 = 448.


def _e4m3_table():
    codes, values = [], []
    for code in range(128):  # positive half
        e, m = code >> 3, code & 7
        if e == 15 and m == 7:
            continue
        v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        codes.append(code)
        values.append(v)
    return np.array(codes), np.array(values)


_CODES, _VALUES = _e4m3_table()


def _ref_e4m3_code(v: float) -> int:
    """Round-to-nearest-even onto e4m3 with saturation to 448 (sign handled separately)."""
    if math.isnan(v):
        return 0x7F
    sign = 0x80 if (v < 0 or (v == 0 and math.copysign(1, v) < 0)) else 0
    a = min(abs(v), 448.0)
    d = np.abs(_VALUES - a)
    best = np.flatnonzero(d == d.min())
    if len(best) > 1:  # a tie: the even mantissa (code LSB 0) wins
        best = [b for b in best if _CODES[b] % 2 == 0]
    return sign | int(_CODES[best[0]])


def _ref_block(block, mode):
    """(codes, scale byte) of one 32-element block per the OCP MX rules (floor) or the no-saturation rule (rceil)."""
    if any(not math.isfinite(v) for v in block):
        return None, 255
    amax = max(abs(v) for v in block)
    if amax == 0:
        x = -127
    elif mode == "floor":
        x = math.frexp(amax)[1] - 1 - 8  # floor(log2(amax)) - emax(e4m3)
    else:
        x = math.ceil(math.log2(amax / 448.0))
        while amax > 448.0 * 2.0**x:  # smallest X with amax / 2^X <= 448, exactly
            x += 1
        while x > -300 and amax <= 448.0 * 2.0 ** (x - 1):
            x -= 1
    x = max(-127, min(127, x))
    return [_ref_e4m3_code(v / 2.0**x) for v in block], x + 127


def _random_blocks(seed, rows=6, blocks=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, blocks, 32, generator=g)
    x = x * torch.exp2(torch.randint(-30, 30, (rows, blocks, 1), generator=g).float())
    x[0, 0] = 0.0
    x[1, 1, :31] = 0.0  # one non-zero element
    x[2, 2] = 448.0 * 2.0**3  # amax exactly at the rceil boundary
    x[2, 3] = torch.nextafter(torch.tensor(448.0 * 4), torch.tensor(1e9))  # just above it
    x[3, 0] = 511.0  # floor saturation
    x[4, 1] *= 1e-38  # tiny values (scale clamped near 2^-127)
    return x.reshape(rows, blocks * 32)


@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("seed", [0, 1])
def test_bit_exact_against_spec_reference(mode, seed):
    x = _random_blocks(seed)
    data, scales = quantize_mxfp8(x, scale_mode=mode)
    codes = data.view(torch.uint8)
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            ref_codes, ref_byte = _ref_block(x[r, b * 32 : (b + 1) * 32].tolist(), mode)
            assert scales[r, b].item() == ref_byte, (r, b)
            assert codes[r, b * 32 : (b + 1) * 32].tolist() == ref_codes, (r, b)


def test_bf16_input_matches_its_float32_value():
    x = _random_blocks(3).clamp(-1e30, 1e30).to(torch.bfloat16)
    d1, s1 = quantize_mxfp8(x, scale_mode="rceil")
    d2, s2 = quantize_mxfp8(x.float(), scale_mode="rceil")
    assert torch.equal(d1.view(torch.uint8), d2.view(torch.uint8)) and torch.equal(s1, s2)


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_round_trip_error_bound_per_block(mode):
    x = _random_blocks(5)
    data, scales = quantize_mxfp8(x, scale_mode=mode)
    y = dequantize(data, scales, block=(1, 32))
    scale = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)
    scaled = x / scale
    in_range = scaled.abs() <= 448
    # RNE on e4m3: relative error <= 2^-4 for normals; absolute <= half a subnormal step (2^-10) * scale
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    err = (y - x).abs()
    assert bool((err[in_range] <= bound[in_range]).all())
    # what does not fit saturates to exactly +-448 * scale (floor only)
    sat = ~in_range
    assert bool(torch.equal(y[sat].abs(), 448 * scale[sat]))
    if mode == "rceil":
        assert not bool(sat.any())
    else:
        assert bool(sat.any())  # the 511 block saturates under floor


def test_rceil_never_saturates_and_uses_the_top_binade():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 32 * 8, generator=g) * torch.exp2(torch.randint(-60, 60, (64, 1), generator=g).float())
    data, scales = quantize_mxfp8(x, scale_mode="rceil")
    blk_max = data.float().abs().reshape(64, 8, 32).amax(-1)
    assert bool((blk_max <= 448).all()) and bool((blk_max >= 224).all())  # amax/2^X in (224, 448], rounded


def test_zero_block_gets_scale_byte_zero_and_decodes_to_zero():
    x = torch.zeros(2, 64)
    x[1, 32:] = 1.0
    data, scales = quantize_mxfp8(x)
    assert scales.tolist() == [[0, 0], [0, 127 - 8]]
    assert torch.equal(dequantize(data, scales, block=(1, 32)), x)


def test_nan_and_inf_poison_only_their_block():
    x = torch.ones(1, 96)
    x[0, 3] = float("nan")
    x[0, 40] = float("inf")
    for mode in ("floor", "rceil"):
        data, scales = quantize_mxfp8(x, scale_mode=mode)
        assert scales[0, :2].tolist() == [255, 255]
        y = dequantize(data, scales, block=(1, 32))
        assert bool(y[0, :64].isnan().all())
        assert torch.equal(y[0, 64:], x[0, 64:])


def test_shapes_dtypes_and_errors():
    x = torch.randn(2, 3, 64)
    data, scales = quantize_mxfp8(x)
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape
    assert scales.dtype == torch.uint8 and scales.shape == (2, 3, 2)
    assert dequantize(data, scales, torch.bfloat16, block=(1, 32)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="block_size=32"):
        quantize_mxfp8(torch.randn(4, 40))
    with pytest.raises(ValueError, match="scale_mode"):
        quantize_mxfp8(x, scale_mode="ceil")
    with pytest.raises(ValueError, match="scales shape"):
        dequantize(data, scales[..., :1], block=(1, 32))
    d16, s16 = quantize_mxfp8(torch.randn(4, 48), block_size=16)
    assert s16.shape == (4, 3)


def test_the_one_dequantize_is_the_block_formula_bit_for_bit():
    # MXFP8 decode: every code times 2^(byte - 127) of its block of 32, in float32, then the cast;
    # 1-D data is one row (the optimizer's fp8 moments: float32 scales per block of a flat vector)
    x = _random_blocks(4).reshape(6, 4 * 32)
    data, scales = quantize_mxfp8(x, scale_mode="rceil")
    want = (data.float().reshape(6, 4, 32) * torch.exp2(scales.float() - 127).unsqueeze(-1)).reshape(x.shape)
    assert torch.equal(dequantize(data, scales, block=(1, 32)), want)
    assert torch.equal(dequantize(data, scales, torch.bfloat16, block=(1, 32)), want.to(torch.bfloat16))
    flat, s = data.reshape(-1), torch.rand(data.numel() // 32) + 0.5
    assert torch.equal(dequantize(flat, s, block=(1, 32)), (flat.float().view(-1, 32) * s[:, None]).view(-1))
    with pytest.raises(ValueError, match=r"scales shape \(3,\)"):
        dequantize(flat, s[:3], block=(1, 32))
