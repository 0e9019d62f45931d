"""The TE backend's glue (weight hand-over, per-expert row padding, recipe mapping) on CPU.

TransformerEngine itself is replaced by a minimal stand-in with the documented interface
(``GroupedLinear(num_gemms, in_features, out_features, ...)`` reading ``weight{i}``,
``forward(inp, m_splits)``, ``fp8_autocast``, the recipe classes) that computes in high precision
and records the calls. This checks only the code around TE; the real kernels are tested by
test_experts_te.py where TE and a GPU exist.
"""
import contextlib
import sys
import types

import pytest
import torch

import folding.moe.experts as experts_mod
from folding.moe.experts import GroupedMLP

CALLS = []


class _StandInGroupedLinear(torch.nn.Module):
    def __init__(self, num_gemms, in_features, out_features, bias=True, params_dtype=None, device=None):
        super().__init__()
        self.num_gemms = num_gemms
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.zeros(out_features, in_features)))

    def forward(self, inp, m_splits):
        CALLS.append(list(m_splits))
        outs, start = [], 0
        for i, m in enumerate(m_splits):
            outs.append(inp[start : start + m] @ getattr(self, f"weight{i}").t())
            start += m
        return torch.cat(outs)


class _Recipe:
    def __init__(self):
        self.name = type(self).__name__


@pytest.fixture
def stand_in_te(monkeypatch):
    te = types.ModuleType("transformer_engine")
    pt = types.ModuleType("transformer_engine.pytorch")
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    pt.GroupedLinear = _StandInGroupedLinear
    pt.fp8_autocast = lambda enabled, fp8_recipe: contextlib.nullcontext(CALLS.append(fp8_recipe.name))
    for name in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling"):
        setattr(recipe, name, type(name, (_Recipe,), {}))
    te.pytorch, te.common, common.recipe = pt, common, recipe
    for name, mod in [("transformer_engine", te), ("transformer_engine.pytorch", pt),
                      ("transformer_engine.common", common), ("transformer_engine.common.recipe", recipe)]:
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(experts_mod, "te_available", lambda: (True, ""))
    CALLS.clear()
    yield


@pytest.mark.parametrize("recipe,te_name,align", [(None, None, 1), ("delayed", "DelayedScaling", 16),
                                                  ("blockwise", "Float8BlockScaling", 16),
                                                  ("mxfp8", "MXFP8BlockScaling", 32)])
def test_te_glue_matches_loop(stand_in_te, recipe, te_name, align):
    kw = dict(num_local_experts=3, hidden_size=8, ffn_hidden_size=6, init_seed=2, init_std=0.3)
    te_mod, ref = GroupedMLP(backend="te", fp8_recipe=recipe, **kw), GroupedMLP(backend="loop", **kw)
    counts = [5, 0, 18]
    g = torch.Generator().manual_seed(0)
    x, p, dy = torch.randn(23, 8, generator=g), torch.rand(23, generator=g), torch.randn(23, 8, generator=g)
    outs = []
    for mod in (te_mod, ref):
        xx = x.clone().requires_grad_()
        y = mod(xx, counts, p)
        y.backward(dy)
        outs.append([y, xx.grad, mod.fc1_weight.grad, mod.fc2_weight.grad])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)
    padded = [-(-c // align) * align for c in counts]
    assert CALLS == ([te_name] if te_name else []) + [padded, padded]
    # the experts own the weights: the kernels hold no parameters of their own
    assert [n for n, _ in te_mod.named_parameters()] == ["fc1_weight", "fc2_weight"]
