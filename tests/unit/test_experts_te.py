"""The TransformerEngine backend against the loop / emulated references (needs TE and a CUDA GPU)."""

import pytest
import torch

from folding.moe.experts.grouped import GroupedMLP
from folding.moe.experts.te import fp8_region, te_available

_OK, _WHY = te_available()
pytestmark = pytest.mark.skipif(not _OK, reason=f"TransformerEngine backend not testable here: {_WHY}")


def _pair(backend, recipe=None):
    kw = dict(num_local_experts=4, hidden_size=128, ffn_hidden_size=256, params_dtype=torch.bfloat16, init_seed=4)
    return GroupedMLP(backend=backend, fp8_recipe=recipe, **kw).cuda()


def _run(mod, x, counts, p, dy):
    x = x.detach().clone().requires_grad_()
    mod.zero_grad(set_to_none=True)
    y = mod(x, counts, p)
    y.backward(dy)
    return [y, x.grad, mod.fc1_weight.grad, mod.fc2_weight.grad]


def _inputs():
    g = torch.Generator().manual_seed(0)
    counts = [37, 0, 64, 19]
    x = torch.randn(sum(counts), 128, generator=g).bfloat16().cuda()
    return (
        x,
        counts,
        torch.rand(x.shape[0], generator=g).cuda(),
        torch.randn(x.shape[0], 128, generator=g).bfloat16().cuda(),
    )


def test_te_bf16_matches_loop():
    x, counts, p, dy = _inputs()
    for a, b in zip(_run(_pair("te"), x, counts, p, dy), _run(_pair("loop"), x, counts, p, dy)):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
def test_te_fp8_close_to_emulation(recipe):
    if recipe == "mxfp8" and torch.cuda.get_device_capability()[0] < 10:
        pytest.skip("MXFP8 needs a Blackwell GPU (compute capability 10+)")
    if recipe == "blockwise" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Float8BlockScaling is the Hopper recipe (compute capability 9)")
    x, counts, p, dy = _inputs()
    with fp8_region(recipe, amax_reduction_group=None, first_microbatch=True):  # as a model chunk opens it
        te_out = _run(_pair("te", recipe), x, counts, p, dy)
    emu = _run(_pair("emulated", recipe), x, counts, p, dy)
    ref = _run(_pair("loop"), x, counts, p, dy)
    for a, b, r in zip(te_out, emu, ref):
        err_te = ((a.float() - r.float()).norm() / r.float().norm()).item()
        err_emu = ((b.float() - r.float()).norm() / r.float().norm()).item()
        assert err_te < 2 * err_emu + 1e-2, (recipe, err_te, err_emu)


def test_every_te_keyword_the_engine_passes_exists_in_the_installed_te():
    import importlib
    import importlib.util
    import inspect

    from folding.moe.experts.te import TE_API

    for path, keywords in TE_API.items():
        parts = path.split(".")
        cut = next(c for c in range(len(parts), 0, -1) if importlib.util.find_spec(".".join(parts[:c])) is not None)
        obj = importlib.import_module(".".join(parts[:cut]))
        for name in parts[cut:]:
            obj = getattr(obj, name)
        params = inspect.signature(obj).parameters
        missing = [k for k in keywords if k not in params]
        assert not missing, f"{path} has no keyword(s) {missing} in this TransformerEngine"


def test_delayed_state_round_trip_without_the_unsafe_pickle_opt_in(monkeypatch):
    monkeypatch.delenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", raising=False)
    x, counts, p, dy = _inputs()
    a = _pair("te", "delayed")
    with fp8_region("delayed", amax_reduction_group=None, first_microbatch=True):
        _run(a, x, counts, p, dy)
    state = a.fp8_state()
    assert state and state["gemms"]["fc1"]["amax_history_fwd"].abs().sum() > 0
    b = _pair("te", "delayed")
    assert b.load_fp8_state(state)
    meta = b._te.gemms["fc1"].fp8_meta
    torch.testing.assert_close(meta["scaling_fwd"].scale.cpu(), state["gemms"]["fc1"]["scale_fwd"])
    with fp8_region("delayed", amax_reduction_group=None, first_microbatch=True):
        _run(b, x, counts, p, dy)  # TE's first forward keeps the restored tensors
    assert meta["scaling_fwd"].amax_history.abs().sum() > 0
