"""The TransformerEngine stand-in refuses, under FP8, the shapes TE 2.20.2's FP8 kernels cannot take.

The rules are the ones ``tests/data/te_api_2.20.2.json`` records (``alignment`` and ``shape_rules``),
run by :meth:`tests.te_rules.Rules.fp8_shape_checks`. One test per rule: each makes a call that only
that rule refuses, and the same call with the shape fixed (or outside FP8) goes through.
"""

import contextlib

import pytest
import torch

from folding.moe.experts.te import make_te_recipe
from tests import te_standin
from tests.te_rules import load_snapshot
from tests.te_standin import RULES

SNAP = load_snapshot()
TE_CLASS = {"delayed": "DelayedScaling", "tensorwise": "Float8CurrentScaling",
            "blockwise": "Float8BlockScaling", "mxfp8": "MXFP8BlockScaling"}  # fmt: skip


@pytest.fixture(autouse=True)
def stand_in(monkeypatch):
    te_standin.install(monkeypatch)
    yield


def _call(recipe, in_features, out_features, splits, grad=True):
    """One ``GroupedLinear`` forward of ``splits`` rows per GEMM, in an FP8 region of ``recipe``
    (none when ``recipe`` is None); with ``grad`` the input needs a gradient (backward GEMMs follow)."""
    mod = te_standin.GroupedLinear(len(splits), in_features, out_features, device="cpu", use_grouped_tensor=False)
    x = torch.randn(sum(splits), in_features, requires_grad=grad)
    region = contextlib.nullcontext() if recipe is None else te_standin.autocast(recipe=make_te_recipe(recipe))
    grad_mode = torch.enable_grad() if grad else torch.no_grad()
    with region, grad_mode:
        return mod(x, splits)


@pytest.mark.parametrize("recipe", sorted(TE_CLASS))
def test_row_alignment_per_split_is_te_s(recipe):
    align = RULES.row_alignment(make_te_recipe(recipe))
    assert align == SNAP["alignment"]["per_recipe"][TE_CLASS[recipe]] == (32 if recipe == "mxfp8" else 16)
    with pytest.raises(ValueError, match=rf"split 1 has {align // 2} rows, not a multiple of {align}"):
        _call(recipe, 32, 32, [align, align // 2])
    _call(recipe, 32, 32, [align, 0, 2 * align])  # aligned splits (an empty one too) go through
    _call(None, 32, 32, [align, align // 2])  # no FP8: any row count


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise"])
def test_fp8_gemm_dims_refuse_a_feature_size_not_divisible_by_16(recipe):
    rule = SNAP["shape_rules"]["fp8_gemm_dims"]
    assert rule == "math.prod(tensor.shape[:-1]) % 8 != 0 or tensor.shape[-1] % 16 != 0"
    # in_features 24: the input [16, 24] of the forward GEMM already fails
    with pytest.raises(ValueError, match=r"refuses the input operand of split 0, shape \[16, 24\]"):
        _call(recipe, 24, 32, [16, 16])
    # out_features 8: the forward operands pass (weight [8, 32]: 8 rows, 32 columns), the output
    # gradient [16, 8] of the backward GEMMs does not; without a gradient the call goes through
    with pytest.raises(ValueError, match=r"refuses the output gradient operand of split 0, shape \[16, 8\]"):
        _call(recipe, 32, 8, [16, 16])
    _call(recipe, 32, 8, [16, 16], grad=False)
    _call(recipe, 32, 32, [16, 16])
    _call(None, 24, 8, [16, 16])  # no FP8: any feature size


def test_mxfp8_is_quantizable_refuses_a_feature_size_not_divisible_by_32():
    # in_features 48 is a multiple of 16 (fp8_gemm_dims holds) but not of 32: only MXFP8 refuses it
    with pytest.raises(ValueError, match=r"MXFP8 quantizer refuses the input operand of split 0, shape \[32, 48\]"):
        _call("mxfp8", 48, 32, [32, 32])
    _call("tensorwise", 48, 32, [32, 32])  # the FP8 rule alone accepts the same call
    _call("mxfp8", 64, 32, [32, 32])
