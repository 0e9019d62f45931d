"""Under an FP8 recipe the experts keep FP8: what each GEMM keeps for backward, and the numbers it gives.

- The ``emulated`` linear keeps its input only as FP8 codes and scales, quantized as its weight gradient
  reads it (along the tokens under block recipes), and keeps no copy of the weight; every output and
  gradient is bit for bit what re-quantizing the high-precision operands in backward gives (the formulas
  of the GEMMs built here from ``quant_dequant``; ``delayed`` with its amax histories over two steps).
- On every backend with a recipe (``emulated``, ``torch`` through the ``torch._scaled_grouped_mm``
  stand-in, ``te`` through the TE stand-in, which keeps what TE's ``_GroupedLinear`` keeps) the experts
  keep none of their high-precision input rows: the storage of fc1's input is freed after the forward.
- ``moe.fp8_act_input_store``: the SwiGLU keeps fc1's output as FP8; its forward is unchanged, its
  gradients are bit for bit those of the high-precision node at the decoded input, their error against
  keeping the exact input is non-zero and within e4m3's rounding; off, the node keeps fc1's output itself.
"""

import pytest
import torch

import folding.moe.experts.select as select_mod
import folding.moe.experts.te as te_mod
from folding.moe.experts.grouped import GroupedMLP
from folding.moe.experts.swiglu import swiglu_prob
from folding.quant import DelayedScaling, emulated_linear, quant_dequant, quantize_operand
from folding.testing.kept_memory import KeptCensus, saved_by_node
from tests import te_standin
from tests.scaled_grouped_mm_standin import recording_stand_in

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8", "rowwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _reference_step(x, w, dy, recipe, state):
    """``(y, dx, dw)`` of ``x·wᵀ`` with every operand re-quantized from the high-precision tensors, the
    forward's per-tensor codes reused in backward (the GEMMs of :mod:`folding.quant.emulate`)."""
    if state is not None:
        qd = lambda t, role, dim: state.quant_dequant(t, ("g", role), E5M2 if role == "grad" else E4M3)  # noqa: E731
    else:
        qd = lambda t, role, dim: quant_dequant(t, recipe, role, dim)  # noqa: E731
    xq, wq = qd(x, "input", -1), qd(w, "weight", -1)
    y = (xq.float() @ wq.float().t()).to(x.dtype)
    if recipe in ("delayed", "tensorwise"):
        gq = qd(dy, "grad", -1).float()
        return y, (gq @ wq.float()).to(x.dtype), (gq.t() @ xq.float()).to(w.dtype)
    dx = (qd(dy, "grad", -1).float() @ qd(w, "weight", 0).float()).to(x.dtype)
    dw = (qd(dy, "grad", 0).float().t() @ qd(x, "input", 0).float()).to(w.dtype)
    return y, dx, dw


@pytest.mark.parametrize("recipe", RECIPES)
def test_emulated_linear_keeps_fp8_and_gives_the_same_bits(recipe):
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(48, 160, generator=gen) * 0.05).bfloat16()
    states = (DelayedScaling(), DelayedScaling()) if recipe == "delayed" else (None, None)
    for step in range(2):  # delayed: the second step runs on scales from the first one's amaxes
        x = (torch.randn(70, 160, generator=gen) * (1 + 3 * step)).bfloat16()
        dy = torch.randn(70, 48, generator=gen).bfloat16()
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = emulated_linear(xx, ww, recipe, delayed=states[0], key=("g",))
        saved = saved_by_node(y, exclude=[ww])  # the weight itself is kept (a parameter), no copy of it
        y.backward(dy)
        want = _reference_step(x, w, dy, recipe, states[1])
        for name, got, ref in zip(("y", "dx", "dw"), (y, xx.grad, ww.grad), want):
            assert torch.equal(got, ref), (recipe, step, name)
        # x's codes (block recipes: along the tokens, [K, M]) and scales; delayed also w's forward scale
        codes = [tuple(s.tensor.shape) for s in saved if s.tensor.dtype == E4M3]
        assert codes == [(70, 160) if recipe in ("delayed", "tensorwise") else (160, 70)], codes
        scales = sum(s.nbytes for s in saved) - x.numel()
        assert scales == {"mxfp8": 160 * 3, "blockwise": 4 * 160, "rowwise": 4 * 160, "delayed": 8}.get(recipe, 4)
        assert not [s.describe() for s in saved if s.tensor.dtype == torch.bfloat16]


@pytest.fixture
def fp8_kernels(monkeypatch):
    """The ``torch`` FP8 path (the ``torch._scaled_grouped_mm`` stand-in) and the ``te`` backend (the TE
    stand-in) runnable on this CPU."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", recording_stand_in)
    monkeypatch.setattr(select_mod, "scaled_grouped_mm_support", lambda recipe, device, dtype: (True, ""))
    te_standin.install(monkeypatch)
    monkeypatch.setattr(te_mod, "te_available", lambda: (True, ""))
    monkeypatch.setattr(select_mod, "te_available", lambda: (True, ""))


CASES = [("emulated", r) for r in RECIPES] + [("torch", "rowwise"), ("torch", "mxfp8")]
CASES += [("te", r) for r in ("tensorwise", "blockwise", "mxfp8")]


@pytest.mark.parametrize("backend,recipe", CASES)
def test_experts_keep_none_of_their_input_rows(fp8_kernels, backend, recipe):
    kw = dict(num_local_experts=4, hidden_size=64, ffn_hidden_size=64, init_seed=1, params_dtype=torch.bfloat16)
    mod = GroupedMLP(backend=backend, fp8_recipe=recipe, **kw)
    counts = [40, 0, 37, 51]
    gen = torch.Generator().manual_seed(2)
    x0, p = torch.randn(128, 64, generator=gen).bfloat16(), torch.rand(128, generator=gen)
    with KeptCensus(mod) as census:
        x = x0.clone().requires_grad_()
        y = mod(census.make(lambda: x * 1), counts, p)  # the dispatcher's rows: held only by the graph
    kept = census.kept(y, x)
    assert not [k for k in kept if k.module == "input"], "the input rows are kept"
    wide = [k for k in kept if k.dtype == torch.bfloat16]  # fc1's output [rows, 2F], which the SwiGLU keeps
    assert len(wide) == 1 and wide[0].shape[1] == 128, [(k.op, k.shape) for k in wide]
    fp8 = sum(k.nbytes for k in kept if k.dtype == E4M3)
    rows = wide[0].shape[0]  # padded to the recipe's alignment on torch and te
    assert fp8 == rows * (64 + 64)  # fc1's input and fc2's (the activation): 1 byte an element
    y.float().sum().backward()  # the kept copies serve the backward
    assert mod.fc1_weight.grad is not None and x.grad is not None


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("recipe", RECIPES)
def test_act_input_store_keeps_fp8_and_rounds_only_the_backward(recipe):
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(96, 2 * 80, generator=gen).bfloat16()
    p, g = torch.rand(96, generator=gen), torch.randn(96, 80, generator=gen).bfloat16()
    runs = {}
    for name, inp, store in (("off", h, None), ("on", h, recipe), ("decoded", None, None)):
        if inp is None:
            inp = quantize_operand(h, recipe, "input", -1).dequantize()  # what "on" keeps, decoded
        hh, pp = inp.clone().requires_grad_(), p.clone().requires_grad_()
        y = swiglu_prob(hh.view_as(hh), pp, fp8_store=store)  # a view: the graph walk lists a kept input
        saved = saved_by_node(y)
        y.backward(g)
        runs[name] = (y, hh.grad, pp.grad, saved)
    off, on, decoded = runs["off"], runs["on"], runs["decoded"]
    assert torch.equal(on[0], off[0])  # the forward uses the exact input
    assert torch.equal(on[1], decoded[1]) and torch.equal(on[2], decoded[2])  # the backward, the decoded one
    err_h, err_p = _rel(on[1], off[1]), _rel(on[2], off[2])
    assert 0 < err_h < 2**-4 and 0 < err_p < 2**-4, (recipe, err_h, err_p)  # e4m3: 3 mantissa bits
    assert [s.tensor.dtype for s in on[3]] in ([E4M3, torch.float32], [E4M3, torch.uint8])
    assert on[3][0].nbytes == h.numel() and off[3][0].tensor.dtype == torch.bfloat16


def test_act_input_store_in_the_experts_and_off_keeps_fc1s_output_itself():
    kw = dict(num_local_experts=2, hidden_size=32, ffn_hidden_size=64, init_seed=3, params_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    x, p, dy = torch.randn(40, 32, generator=gen).bfloat16(), torch.rand(40, generator=gen), torch.randn(40, 32)
    grads = {}
    for store in (False, True):
        mod = GroupedMLP(backend="emulated", fp8_recipe="mxfp8", fp8_act_input_store=store, **kw)
        xx = x.clone().requires_grad_()
        y = mod(xx, [25, 15], p)
        node = [s for s in saved_by_node(y) if s.node == "_SwiGLUProbBackward"]
        assert node[0].tensor.dtype == (E4M3 if store else torch.bfloat16)
        y.backward(dy.bfloat16())
        grads[store] = [xx.grad, mod.fc1_weight.grad, mod.fc2_weight.grad]
    for a, b in zip(grads[True][:2], grads[False][:2]):  # upstream of the activation: dx, dW1
        assert 0 < _rel(a, b) < 2**-4
    assert torch.equal(grads[True][2], grads[False][2])  # fc2's weight gradient reads the exact activation
    with pytest.raises(ValueError, match="fp8_act_input_store=True"):
        GroupedMLP(backend="loop", fp8_act_input_store=True, **kw)
