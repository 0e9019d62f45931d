"""The quantizations of the ``torch`` FP8 experts allocate at most one float32 tensor of their input's size.

Each expert GEMM quantizes its ``[N, H]`` input (per row for the forward, per column of each expert's
rows for the weight gradient, or in MXFP8 blocks) once per micro-batch; a float32 copy of ``[N, H]``
is twice the bf16 input, so every extra one is memory and bandwidth per layer. A dispatch mode sees
every aten op and counts the new float32 tensors (not views, not in-place results) of at least the
input's element count. The numbers themselves are checked elsewhere (``test_quant_fp8.py``,
``test_experts_torch_fp8.py``, ``test_fp8_kept.py``).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from folding.moe.experts import mxfp8 as expert_mxfp8
from folding.moe.experts import scaled
from folding.quant import cast_to_fp8, quantize_fp8_rowwise, quantize_mxfp8


class Fp32Allocations(TorchDispatchMode):
    """Records the aten ops that return a new float32 tensor of at least ``numel`` elements."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel = numel
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = tree_flatten((args, kwargs))[0]
        inputs = {t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if (
                isinstance(t, torch.Tensor)
                and t.dtype == torch.float32
                and t.numel() >= self.numel
                and t.untyped_storage().data_ptr() not in inputs
            ):
                self.ops.append(str(func))
        return out


def _x(n=96, h=64, dtype=torch.bfloat16):
    x = torch.randn(n, h, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[3, 5], x[7, 0], x[8, 1] = float("nan"), float("inf"), float("-inf")  # the special values' paths too
    return x


COUNTS = (32, 16, 48)  # rows per expert, aligned to 16 and 32


@pytest.mark.parametrize(
    "name, quantize",
    [
        ("rowwise forward operand", lambda x: quantize_fp8_rowwise(x, torch.float8_e4m3fn, power_2_scale=True)),
        ("rowwise weight-gradient operand", lambda x: scaled._rowwise_wgrad_input(x, torch.tensor(COUNTS), COUNTS)),
        ("mxfp8 forward operand", lambda x: expert_mxfp8._quantize(x)),
        ("mxfp8 weight-gradient operand", lambda x: expert_mxfp8.mx_wgrad_input(x, torch.tensor(COUNTS), COUNTS)),
        ("mxfp8 wire", lambda x: quantize_mxfp8(x, 32, "rceil")),
        ("cast", lambda x: cast_to_fp8(x, torch.float8_e4m3fn)),
    ],
)
def test_a_quantization_makes_at_most_one_float32_copy_of_its_input(name, quantize):
    x = _x()
    with Fp32Allocations(x.numel()) as seen:
        quantize(x)
    assert len(seen.ops) <= 1, f"{name}: {len(seen.ops)} float32 tensors of the input's size: {seen.ops}"
