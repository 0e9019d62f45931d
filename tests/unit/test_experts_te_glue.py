"""The TransformerEngine path on CPU, through a stand-in with TE's interface.

The stand-in has exactly the signatures the engine relies on (``GroupedLinear(num_gemms,
in_features, out_features, bias, params_dtype, device)`` reading ``weight{i}``, ``forward(inp,
m_splits, is_first_microbatch)``, ``autocast(enabled, recipe, amax_reduction_group)``, the
``is_*_available(return_reason)`` checks, ``get/set_extra_state``), computes in high precision and
records every call. Checked here: numerics against the loop backend, one FP8 region per model-chunk
forward with the chunk's DP×CP group, ``delayed`` refused outside a region, ``is_first_microbatch``,
one padding around fc1→fc2, TE modules built on ``meta``, FP8 state round trip, backend selection
with TE's reasons. The real kernels are exercised by test_experts_te.py where TE and a GPU exist
(not run on CPU machines).
"""

import contextlib
import sys
import types

import pytest
import torch

import folding.moe.expert_select as select_mod
import folding.moe.expert_te as te_mod
import folding.moe.experts as experts_mod
from folding.model.presets import get_preset
from folding.model.transformer import MoETransformer
from folding.moe.expert_select import BackendError, backend_support, check_backend, resolve_backend
from folding.moe.expert_te import TE_API, fp8_region
from folding.moe.experts import GroupedMLP

CALLS = []
SUPPORT = {}


class _StandInGroupedLinear(torch.nn.Module):
    def __init__(self, num_gemms, in_features, out_features, bias=True, params_dtype=None, device="cuda"):
        super().__init__()
        CALLS.append(("build", str(device)))
        self.num_gemms, self.state = num_gemms, torch.zeros(2)
        for i in range(num_gemms):
            self.register_parameter(
                f"weight{i}", torch.nn.Parameter(torch.empty(out_features, in_features, device=device))
            )

    def forward(self, inp, m_splits, is_first_microbatch=None):
        CALLS.append(("gemm", list(m_splits), is_first_microbatch))
        self.state += 1
        return torch.cat([x @ getattr(self, f"weight{i}").t() for i, x in enumerate(inp.split(list(m_splits)))])

    def get_extra_state(self):
        return self.state.clone()

    def set_extra_state(self, state):
        self.state = state.clone()


class _Recipe:
    def __init__(self):
        self.name = type(self).__name__


@contextlib.contextmanager
def _autocast(enabled=True, recipe=None, amax_reduction_group=None):
    CALLS.append(("enter", recipe.name, amax_reduction_group))
    yield
    CALLS.append(("exit",))


def _check(name):
    return lambda return_reason=False: SUPPORT.get(name, (True, ""))


@pytest.fixture
def stand_in_te(monkeypatch):
    te = types.ModuleType("transformer_engine")
    pt = types.ModuleType("transformer_engine.pytorch")
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    pt.GroupedLinear, pt.autocast = _StandInGroupedLinear, _autocast
    for name in ("is_fp8_available", "is_fp8_block_scaling_available", "is_mxfp8_available"):
        setattr(pt, name, _check(name))
    for name in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling"):
        setattr(recipe, name, type(name, (_Recipe,), {}))
    te.pytorch, te.common, common.recipe = pt, common, recipe
    for name, mod in [
        ("transformer_engine", te),
        ("transformer_engine.pytorch", pt),
        ("transformer_engine.common", common),
        ("transformer_engine.common.recipe", recipe),
    ]:
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(te_mod, "te_available", lambda: (True, ""))
    monkeypatch.setattr(select_mod, "te_available", lambda: (True, ""))
    CALLS.clear()
    SUPPORT.clear()
    yield


@pytest.fixture
def te_on_cpu(stand_in_te, monkeypatch):
    """Let the experts resolve ``te`` on this CPU (the device check is tested separately)."""
    monkeypatch.setattr(
        experts_mod,
        "resolve_backend",
        lambda backend, recipe, device, dtype: "te" if backend in ("te", "auto") else backend,
    )
    yield


KW = dict(num_local_experts=3, hidden_size=8, ffn_hidden_size=6, init_seed=2, init_std=0.3)


@pytest.mark.parametrize(
    "recipe,te_name,align",
    [
        (None, None, 1),
        ("delayed", "DelayedScaling", 16),
        ("tensorwise", "Float8CurrentScaling", 16),
        ("blockwise", "Float8BlockScaling", 16),
        ("mxfp8", "MXFP8BlockScaling", 32),
    ],
)
def test_te_path_matches_loop(te_on_cpu, recipe, te_name, align):
    te, ref = GroupedMLP(backend="te", fp8_recipe=recipe, **KW), GroupedMLP(backend="loop", **KW)
    counts = [5, 0, 18]
    g = torch.Generator().manual_seed(0)
    x, p, dy = torch.randn(23, 8, generator=g), torch.rand(23, generator=g), torch.randn(23, 8, generator=g)
    outs = []
    region = (
        fp8_region(recipe, amax_reduction_group="dp_cp", first_microbatch=True)
        if recipe == "delayed"
        else contextlib.nullcontext()
    )
    for mod in (te, ref):
        xx = x.clone().requires_grad_()
        with region if mod is te else contextlib.nullcontext():
            y = mod(xx, counts, p)
        y.backward(dy)
        outs.append([y, xx.grad, mod.fc1_weight.grad, mod.fc2_weight.grad])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)
    padded = [-(-c // align) * align for c in counts]
    gemms = [c for c in CALLS if c[0] == "gemm"]
    assert [c[1] for c in gemms] == [padded, padded]  # fc1 and fc2 both see the aligned rows: one pad
    builds = [c for c in CALLS if c[0] == "build"]
    assert builds == [("build", "meta"), ("build", "meta")]  # no throwaway weight
    regions = [c for c in CALLS if c[0] == "enter"]
    if recipe is None:
        assert regions == []
    elif recipe == "delayed":
        assert regions == [("enter", te_name, "dp_cp")] and gemms[0][2] is True
    else:  # standalone experts open a local region for recipes without an amax history
        assert regions == [("enter", te_name, None)]
    assert [n for n, _ in te.named_parameters()] == ["fc1_weight", "fc2_weight"]


def test_delayed_outside_a_region_is_refused(te_on_cpu):
    mod = GroupedMLP(backend="te", fp8_recipe="delayed", **KW)
    with pytest.raises(RuntimeError, match="one FP8 region per model-chunk forward"):
        mod(torch.randn(4, 8), [4, 0, 0], torch.rand(4))


def test_one_region_per_chunk_forward_with_the_dp_cp_group(te_on_cpu):
    cfg = get_preset("mixtral_tiny")
    model = MoETransformer(cfg.replace(moe={"expert_backend": "te", "fp8_recipe": "delayed"}), init_seed=1)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    for m in range(3):  # three micro-batches of one step
        CALLS.clear()
        model.stage_forward(ids, labels=ids, first_microbatch=m == 0).sum().backward()
        enters = [c for c in CALLS if c[0] == "enter"]
        assert enters == [("enter", "DelayedScaling", model.groups.dp_cp)]  # one, not one per layer
        gemms = [c for c in CALLS if c[0] == "gemm"]
        assert len(gemms) == 2 * cfg.num_moe_layers()
        assert {c[2] for c in gemms} == {m == 0}


def test_fp8_state_round_trip_and_layout_check(te_on_cpu):
    a = GroupedMLP(backend="te", fp8_recipe="mxfp8", **KW)
    assert a.fp8_state() == {}  # TE has not run: nothing to save
    a(torch.randn(4, 8), [1, 2, 1], torch.rand(4))
    state = a.fp8_state()
    assert state["gemms"]["fc1"].tolist() == [1.0, 1.0]
    b = GroupedMLP(backend="te", fp8_recipe="mxfp8", **KW)
    assert b.load_fp8_state(state)
    assert b._te.gemms["fc1"].get_extra_state().tolist() == [1.0, 1.0]
    other = GroupedMLP(backend="te", fp8_recipe="mxfp8", **dict(KW, expert_offset=3, num_experts=6))
    assert not other.load_fp8_state(state)  # other experts: TE recalibrates instead


def test_every_te_keyword_the_engine_uses_is_listed(te_on_cpu):
    # the stand-in's signatures are TE's; the engine calls them by keyword, so a keyword outside
    # TE_API (or a renamed one) fails here as it would on a real TE
    mod = GroupedMLP(backend="te", fp8_recipe="mxfp8", **KW)
    mod(torch.randn(4, 8), [4, 0, 0], torch.rand(4))
    assert set(TE_API["transformer_engine.pytorch.GroupedLinear.forward"]) == {"inp", "m_splits", "is_first_microbatch"}


def test_backend_selection_uses_te_checks(stand_in_te):
    cuda = torch.device("cuda", 0)
    SUPPORT["is_mxfp8_available"] = (False, "Device compute capability 10.0 or higher required for MXFP8 execution.")
    ok, why = backend_support("te", "mxfp8", cuda)
    assert not ok and "10.0 or higher" in why
    assert backend_support("te", "blockwise", cuda) == (True, "")
    with pytest.raises(BackendError, match="moe.fp8_recipe='mxfp8'.*10.0 or higher.*moe.expert_backend=auto"):
        check_backend("te", "mxfp8", cuda)
    with pytest.warns(RuntimeWarning, match="runs the emulated backend"):
        assert resolve_backend("auto", "mxfp8", cuda, torch.bfloat16) == "emulated"
    assert resolve_backend("auto", "blockwise", cuda, torch.bfloat16) == "te"
    # no GPU: auto never picks te, and says nothing (not a fallback on a GPU)
    assert resolve_backend("auto", None, torch.device("cpu"), torch.float32) == "torch"
    ok, why = backend_support("te", None, torch.device("cpu"))
    assert not ok and "CUDA" in why
    with pytest.raises(BackendError, match="cannot run on cpu"):
        GroupedMLP(backend="te", device="cpu", **KW)  # at construction, before any step


def _autograd_node_names(y):
    seen, stack, names = set(), [y.grad_fn], []
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(type(fn).__name__)
        stack.extend(f for f, _ in fn.next_functions)
    return names


@pytest.mark.parametrize("num_experts", [8, 32])
def test_te_backend_backward_has_no_per_expert_select_nodes(te_on_cpu, num_experts):
    # each per-expert select view would add a SelectBackward node that allocates a zero tensor the
    # size of the whole [E, O, K] weight in backward; one unbind per weight hands all E over at once
    mod = GroupedMLP(backend="te", **dict(KW, num_local_experts=num_experts))
    counts = [i % 3 for i in range(num_experts)]
    n = sum(counts)
    y = mod(torch.randn(n, 8), counts, torch.rand(n))
    names = _autograd_node_names(y)
    assert not [m for m in names if m.startswith("Select")], names
    assert names.count("UnbindBackward0") == 2  # fc1 and fc2, whatever E is
    y.sum().backward()
    assert mod.fc1_weight.grad.shape[0] == num_experts and mod.fc2_weight.grad.shape[0] == num_experts


def test_loop_backend_backward_has_no_per_expert_select_nodes():
    mod = GroupedMLP(backend="loop", **dict(KW, num_local_experts=8))
    counts = [3, 1, 0, 2, 4, 1, 2, 3]
    y = mod(torch.randn(16, 8), counts, torch.rand(16))
    names = _autograd_node_names(y)
    assert not [n for n in names if n.startswith("Select")], names
    assert names.count("UnbindBackward0") == 2  # one per weight (fc1, fc2), whatever E is


def test_te_extra_pins_the_range_the_backend_was_written_against():
    import os

    setup = os.path.join(os.path.dirname(__file__), "..", "..", "setup.py")
    with open(setup, encoding="utf-8") as f:
        assert f'"transformer_engine[pytorch]{te_mod.TE_VERSION_RANGE}"' in f.read()
