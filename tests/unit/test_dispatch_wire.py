"""Wire formats: exact bytes for ``none``, bounded error and byte counts for ``fp8`` / ``mxfp8``, clear errors."""

import pytest
import torch

from folding.moe.dispatch.wire import check_wire, check_wire_format, decode, encode, payload_bytes_per_row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_none_wire_is_bit_exact_and_copies_nothing(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 6, generator=g).to(dtype)
    (b,) = encode(x, "none")
    # one part: the rows' own bytes, H elements of the dtype per row, a view of x (no copy)
    assert b.dtype == torch.uint8 and b.shape == (5, 6 * x.element_size())
    assert b.data_ptr() == x.data_ptr()
    x2 = decode([b.clone()], "none", 6, dtype)
    assert torch.equal(x2, x)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_quantized_wire_error_and_bytes(fmt):
    g = torch.Generator().manual_seed(1)
    H = 64
    # magnitudes spread over 2^-3 .. 2^3 inside each row: stays in e4m3's normal range after scaling
    x = torch.randn(7, H, generator=g) * torch.exp2(torch.randint(-3, 4, (7, H), generator=g).float())
    parts = encode(x, fmt)
    assert all(q.dtype == torch.uint8 for q in parts)
    assert sum(q.shape[1] for q in parts) == payload_bytes_per_row(fmt, H, torch.float32)
    assert payload_bytes_per_row(fmt, H, torch.float32) == (H + 4 if fmt == "fp8" else H + H // 32)
    x2 = decode(parts, fmt, H, torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 on normals, plus half a subnormal step
    # (2^-10 * scale) for the smallest values of a block/row; scale <= 2 * amax / 448
    amax = x.abs().amax(1, keepdim=True)
    bound = 2.0**-4 * x.abs() + 2.0**-10 * 2 * amax / 448
    assert ((x2 - x).abs() <= bound).all()
    assert (x2 != x).any()  # it did quantize


@pytest.mark.parametrize("fmt", ["none", "fp8", "mxfp8"])
def test_zero_rows_round_trip(fmt):
    # a rank that receives no tokens encodes and decodes an empty [0, H] block
    x = torch.empty(0, 64)
    parts = encode(x, fmt)
    assert all(q.shape[0] == 0 for q in parts)
    assert sum(q.shape[1] for q in parts) == payload_bytes_per_row(fmt, 64, torch.float32)
    x2 = decode(parts, fmt, 64, torch.float32)
    assert x2.shape == (0, 64)


def test_mxfp8_halves_bf16_bytes():
    # (H + H/32) / 2H = 0.515625 for any H multiple of 32
    assert payload_bytes_per_row("mxfp8", 1024, torch.bfloat16) / payload_bytes_per_row(
        "none", 1024, torch.bfloat16
    ) == pytest.approx(0.515625)


def test_check_wire_errors_name_the_setting():
    with pytest.raises(ValueError, match=r"moe.dispatch_wire='int4'.*choose one of"):
        check_wire_format("moe.dispatch_wire", "int4")  # once, when a dispatcher is built
    with pytest.raises(ValueError, match=r"moe.combine_wire=mxfp8 needs the hidden size to be a multiple of 32"):
        check_wire("moe.combine_wire", "mxfp8", torch.bfloat16, 48)
    with pytest.raises(ValueError, match=r"moe.grad_wire='fp8' quantizes from fp32/bf16/fp16"):
        check_wire("moe.grad_wire", "fp8", torch.float64, 64)
    check_wire("moe.dispatch_wire", "fp8", torch.bfloat16, 48)  # fp8 rowwise has no block constraint


def test_padded_chunks_skip_the_etp_padding():
    from folding.moe.dispatch.permute import sort_chunks_by_idxs
    from folding.moe.dispatch.wire import padded_chunks

    # 2 ETP ranks x 2 chunks each: rank 0 holds chunks of 1 and 2 rows (3 rows), rank 1 of 2 and 3
    # (5 rows); gathered in padded blocks of 5 rows, so 2 padding rows follow rank 0's chunks
    sizes, order = padded_chunks([1, 2, 2, 3], [0, 2, 1, 3], [3, 5])
    assert sizes == [1, 2, 2, 2, 3, 0] and order == [0, 3, 1, 4]
    # rows labelled by (chunk, i); padding rows are -1
    x = torch.tensor([0, 1, 1, -1, -1, 2, 2, 3, 3, 3], dtype=torch.float32).unsqueeze(1)
    got = sort_chunks_by_idxs(x, sizes, order).squeeze(1).tolist()
    assert got == [0, 2, 2, 1, 1, 3, 3, 3]  # chunks 0, 2, 1, 3 and no padding row


def test_to_padded_blocks_inverts_the_padded_sort():
    from folding.moe.dispatch.permute import sort_chunks_by_idxs
    from folding.moe.dispatch.wire import padded_chunks, to_padded_blocks

    # the same 4 chunks as above, now as the experts produced them: expert-major order 0, 2, 1, 3
    x = torch.tensor([0, 2, 2, 1, 1, 3, 3, 3], dtype=torch.float32).unsqueeze(1).requires_grad_()
    y = to_padded_blocks(x, [1, 2, 2, 3], [0, 2, 1, 3], [3, 5])
    # rank 0's block: chunks 0 and 1 (3 rows) then 2 zero rows up to 5; rank 1's block: chunks 2, 3
    assert y.squeeze(1).tolist() == [0, 1, 1, 0, 0, 2, 2, 3, 3, 3]
    # the dispatch-side sort of the same padded layout gives x back
    sizes, order = padded_chunks([1, 2, 2, 3], [0, 2, 1, 3], [3, 5])
    assert torch.equal(sort_chunks_by_idxs(y, sizes, order), x)
    # the gradient of the padding rows goes nowhere; every other row's returns to its source row
    g = torch.arange(10, dtype=torch.float32).unsqueeze(1)
    (y * g).sum().backward()
    assert x.grad.squeeze(1).tolist() == [0, 5, 6, 1, 2, 7, 8, 9]
    # equal blocks (chunks of 2, 2 | 1, 3 rows): no padding row, just the unsort
    z = to_padded_blocks(x.detach(), [2, 2, 1, 3], [0, 2, 1, 3], [4, 4])
    assert z.squeeze(1).tolist() == [0, 2, 1, 1, 2, 3, 3, 3]


@pytest.mark.parametrize("fmt,recipe", [("fp8", "rowwise"), ("mxfp8", "mxfp8")])
def test_wire_rows_reach_the_matching_expert_recipe_without_a_second_rounding(fmt, recipe):
    from folding.quant import quant_dequant

    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 96, generator=g) * torch.exp2(torch.randint(-10, 10, (64, 1), generator=g).float())
    rows = decode(encode(x.bfloat16(), fmt), fmt, 96, torch.bfloat16)
    assert not torch.equal(rows, x.bfloat16())  # the wire quantized
    # fc1's forward quantizes its input along the hidden size: the wire's values come back unchanged
    assert torch.equal(quant_dequant(rows, recipe, "input", -1), rows)
