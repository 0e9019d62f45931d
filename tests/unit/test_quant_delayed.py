"""Delayed scaling, emulated: scales come from earlier amaxes (TransformerEngine's DelayedScaling)."""

import torch

from folding.moe.experts.grouped import GroupedMLP
from folding.quant import DelayedScaling, quant_dequant

E4M3 = torch.float8_e4m3fn


def test_first_use_has_scale_one_and_saturates_then_follows_history():
    state = DelayedScaling(history_len=2)
    x = torch.full((4,), 1000.0)
    first = state.quant_dequant(x, ("a",), E4M3)
    assert torch.equal(first, torch.full((4,), 448.0))  # scale 1: 1000 saturates
    assert state.scale(("a",)) == float(torch.tensor(448.0) / torch.tensor(1000.0))  # float32 math
    second = state.quant_dequant(x, ("a",), E4M3)
    assert torch.allclose(second, x, rtol=2.0**-4)
    # a small tensor is cast with the scale of the max over the history (still 1000)
    small = torch.full((4,), 0.01)
    state.quant_dequant(small, ("a",), E4M3)
    assert state.scale(("a",)) == float(torch.tensor(448.0) / torch.tensor(1000.0))
    state.quant_dequant(small, ("a",), E4M3)  # history [0.01, 0.01]: the 1000 has left
    assert state.scale(("a",)) == float(torch.tensor(448.0) / small.max())
    assert state.scale(("b",)) == 1.0  # keys are independent


def test_delayed_equals_tensorwise_once_the_history_has_seen_the_same_tensors():
    kw = dict(num_local_experts=3, hidden_size=16, ffn_hidden_size=32, init_std=0.2, backend="emulated")
    delayed, current = GroupedMLP(fp8_recipe="delayed", **kw), GroupedMLP(fp8_recipe="tensorwise", **kw)
    g = torch.Generator().manual_seed(0)
    counts = [6, 0, 9]
    x, p, dy = torch.randn(15, 16, generator=g) * 30, torch.rand(15, generator=g), torch.randn(15, 16, generator=g)

    def step(mod):
        mod.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y = mod(xx, counts, p)
        y.backward(dy)
        return [y, xx.grad, mod.fc1_weight.grad, mod.fc2_weight.grad]

    delayed.delayed_scaling = DelayedScaling(history_len=1)
    ref = step(current)
    first = step(delayed)  # scale 1 everywhere: differs from current scaling
    assert any(not torch.equal(a, b) for a, b in zip(first, ref))
    # step 2: fc1's operands get scales from identical amaxes, but fc2's input and fc1's output
    # gradient still carry step 1's amaxes (they depended on step 1's coarser fc1); from step 3
    # on every scale equals the current amax's: exactly current scaling
    step(delayed)
    third = step(delayed)
    for a, b in zip(third, ref):
        assert torch.equal(a, b)
    # histories are per GEMM, expert and operand role
    keys = set(delayed.delayed_scaling._scale)
    assert ("fc1", 0, "input") in keys and ("fc2", 2, "grad") in keys and not any(k[1] == 1 for k in keys)


def test_without_state_delayed_uses_the_current_amax():
    x = torch.randn(8, 8) * 100
    assert torch.equal(quant_dequant(x, "delayed"), quant_dequant(x, "tensorwise"))
