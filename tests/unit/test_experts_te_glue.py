"""The TransformerEngine path on CPU, through the stand-in of TE in ``tests/te_standin.py``.

The stand-in has TE 2.20.2's signatures and recorded rules (``tests/unit/test_te_snapshot.py`` holds
it to ``tests/data/te_api_2.20.2.json``), computes in high precision and records every call. Checked
here: numerics against the loop backend (under FP8 the weight gradients read the FP8 copy of each
GEMM's input that TE keeps, the stand-in too), one FP8 region per model-chunk forward with the chunk's
DP×CP group, ``delayed`` refused outside a region, ``is_first_microbatch``, one padding around
fc1→fc2, TE modules built on ``meta`` with an explicit ``use_grouped_tensor``, no FP8 state for the
stateless recipes, backend selection with TE's reasons. The ``delayed`` state round trip is in
test_te_snapshot.py. The real kernels are exercised by test_experts_te.py where TE and a GPU exist
(not run on CPU machines).
"""

import contextlib
import warnings

import pytest
import torch

import folding.moe.experts.select as select_mod
import folding.moe.experts.te as te_mod
from folding.model.presets import get_preset
from folding.model.transformer import MoETransformer
from folding.moe.experts.grouped import GroupedMLP
from folding.moe.experts.select import BackendError, backend_support, check_backend, resolve_backend
from folding.moe.experts.te import fp8_region
from folding.moe.settings import LayerSettings
from tests import te_standin
from tests.te_standin import CALLS, SUPPORT


@pytest.fixture
def stand_in_te(monkeypatch):
    te_standin.install(monkeypatch)
    monkeypatch.setattr(te_mod, "te_available", lambda: (True, ""))
    monkeypatch.setattr(select_mod, "te_available", lambda: (True, ""))
    yield


@pytest.fixture
def te_on_cpu(stand_in_te):
    """The experts run ``te`` on this CPU through the stand-in: the backend is given to them, not
    resolved for the device (the device check is tested separately)."""
    yield


KW = dict(num_local_experts=3, hidden_size=32, ffn_hidden_size=32, init_seed=2, init_std=0.3)
H = KW["hidden_size"]  # H, 2F and F multiples of 32: shapes every FP8 recipe of TE takes (MXFP8 the strictest)


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
    x, p, dy = torch.randn(23, H, generator=g), torch.rand(23, generator=g), torch.randn(23, H, generator=g)
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
    if recipe is None:
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b)
    else:  # TE's FP8 numerics: the emulated backend's (the stand-in rounds as TE's kernels do), to fp32
        # round-off of the summation order (1e-7 here), far below one FP8 step (2^-3 relative for e4m3)
        emulated = _emulated_run(te_standin.KEPT_FORMAT[te_name], x, counts, p, dy)
        for a, b in zip(outs[0], emulated):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(outs[0], outs[1]):  # and FP8's error, of FP8's size, against the exact product
            err = ((a - b).norm() / b.norm()).item()
            assert 1e-3 < err < 0.15, (recipe, err)
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


def _emulated_run(fmt, x, counts, p, dy):
    """Output, input gradient and weight gradients of the ``emulated`` experts (the project's FP8 emulation)
    with the same weights, on the unpadded rows."""
    mod = GroupedMLP(backend="emulated", fp8_recipe=fmt, **KW)
    xx = x.clone().requires_grad_()
    y = mod(xx, counts, p)
    y.backward(dy)
    return [y, xx.grad, mod.fc1_weight.grad, mod.fc2_weight.grad]


def test_delayed_outside_a_region_is_refused(te_on_cpu):
    mod = GroupedMLP(backend="te", fp8_recipe="delayed", **KW)
    with pytest.raises(RuntimeError, match="one FP8 region per model-chunk forward"):
        mod(torch.randn(4, H), [4, 0, 0], torch.rand(4))


def test_one_region_per_chunk_forward_with_the_dp_cp_group(te_on_cpu):
    cfg = get_preset("mixtral_tiny")
    model = MoETransformer(
        cfg.replace(moe={"expert_backend": "te", "fp8_recipe": "delayed"}),
        settings=LayerSettings(init_seed=1, expert_backend="te"),
    )
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    for m in range(3):  # three micro-batches of one step
        CALLS.clear()
        model.stage_forward(ids, labels=ids, first_microbatch=m == 0).sum().backward()
        enters = [c for c in CALLS if c[0] == "enter"]
        assert enters == [("enter", "DelayedScaling", model.groups.dp_cp)]  # one, not one per layer
        gemms = [c for c in CALLS if c[0] == "gemm"]
        assert len(gemms) == 2 * cfg.num_moe_layers()
        assert {c[2] for c in gemms} == {m == 0}


def test_stateless_recipes_save_no_fp8_state(te_on_cpu):
    a = GroupedMLP(backend="te", fp8_recipe="mxfp8", **KW)
    a(torch.randn(4, H), [1, 2, 1], torch.rand(4))
    assert a.fp8_state() == {}  # TE's extra state is empty for mxfp8: nothing to save
    assert a._te.gemms["fc1"].get_extra_state().numel() == 0


def test_te_modules_get_an_explicit_use_grouped_tensor(te_on_cpu, monkeypatch):
    # the deprecated variable would turn on TE's native path, which raises on host m_splits
    monkeypatch.setenv("NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM", "1")
    mod = GroupedMLP(backend="te", fp8_recipe="mxfp8", **KW)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # TE's deprecation warning for the env var
        mod(torch.randn(4, H), [1, 2, 1], torch.rand(4))  # no error either
    assert [g.use_grouped_tensor for g in mod._te.gemms.values()] == [False, False]
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="requires CUDA m_splits"):
        te_standin.GroupedLinear(3, 8, 4, device="cpu")(torch.randn(3, 8), [1, 1, 1])  # what the env var alone did


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
    y = mod(torch.randn(n, H), counts, torch.rand(n))
    names = _autograd_node_names(y)
    assert not [m for m in names if m.startswith("Select")], names
    assert names.count("UnbindBackward0") == 2  # fc1 and fc2, whatever E is
    y.sum().backward()
    assert mod.fc1_weight.grad.shape[0] == num_experts and mod.fc2_weight.grad.shape[0] == num_experts


def test_loop_backend_backward_has_no_per_expert_select_nodes():
    mod = GroupedMLP(backend="loop", **dict(KW, num_local_experts=8))
    counts = [3, 1, 0, 2, 4, 1, 2, 3]
    y = mod(torch.randn(16, H), counts, torch.rand(16))
    names = _autograd_node_names(y)
    assert not [n for n in names if n.startswith("Select")], names
    assert names.count("UnbindBackward0") == 2  # one per weight (fc1, fc2), whatever E is


def test_te_extra_pins_the_range_the_backend_was_written_against():
    import os

    setup = os.path.join(os.path.dirname(__file__), "..", "..", "setup.py")
    with open(setup, encoding="utf-8") as f:
        assert f'"transformer_engine[pytorch]{te_mod.TE_VERSION_RANGE}"' in f.read()
