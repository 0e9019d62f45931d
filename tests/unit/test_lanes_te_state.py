"""TransformerEngine's FP8 autocast state is process-global, and the lanes of an overlap pair share it.

TE keeps the region's depth, recipe, group, its first FP8 module and the amax buffers per process
(``FP8GlobalStateManager``), not per thread; the CPU stand-in (``tests/te_standin.py``) does the same.
A model chunk's FP8 region stays open across the MoE exchanges, where the lanes of a pair hand over,
so the other lane runs inside it: a module that runs without FP8 when the two lanes run one after the
other runs FP8 in the pair, and takes the region's first-module role from the lane that opened it.
The engine therefore refuses TE with an FP8 recipe and ``parallel.overlap_moe_comm`` at validation,
and :func:`folding.moe.experts.te.fp8_region` refuses to open inside a pair.
"""

import pytest
import torch

from folding.job.config import ConfigError
from folding.job.validate import validate_job
from folding.moe.experts.te import fp8_region, make_te_recipe
from folding.overlap.exchange import Exchange
from folding.overlap.runtime import OverlapRuntime
from tests import te_standin
from tests.unit.test_config_job import job

overlap = OverlapRuntime()
"""The runtime every test of this file runs under (current through the autouse fixture below)."""


@pytest.fixture(autouse=True)
def _current_runtime():
    with overlap.active():
        yield


class _Done:
    def wait(self):
        pass


@pytest.fixture
def te(monkeypatch):
    te_standin.install(monkeypatch)
    return te_standin


def _lanes(te):
    """Lane a opens TE's region, runs one module and waits on an exchange inside it; lane b runs a
    module outside any region of its own (e.g. the recompute of an expert in a backward)."""
    mod_a, mod_b = te.GroupedLinear(1, 16, 16, device="cpu"), te.GroupedLinear(1, 16, 16, device="cpu")
    x = torch.randn(16, 16)

    def a():
        with te.autocast(enabled=True, recipe=make_te_recipe("tensorwise")):
            Exchange([_Done()], what="ep test").wait()
            mod_a(x, [16])

    def b():
        mod_b(x, [16])

    return a, b, mod_a, mod_b


def test_the_standin_autocast_state_is_shared_by_the_lanes(te):
    a, b, mod_a, mod_b = _lanes(te)
    a(), b()  # one after the other: b runs without FP8, a's module is its region's first
    assert (mod_a.fp8, mod_a.first_fp8_module, mod_b.fp8) == (True, True, False)
    a, b, mod_a, mod_b = _lanes(te)
    overlap.run_pair(a, b)  # b runs while a waits inside its region
    assert (mod_b.fp8, mod_b.first_fp8_module) == (True, True)  # inside the other lane's region, and its first
    assert (mod_a.fp8, mod_a.first_fp8_module) == (True, False)
    assert te._REGION["depth"] == 0 and te._REGION["recipe"] is None


def test_an_fp8_region_does_not_open_inside_a_pair(te):
    def forward():
        with fp8_region("tensorwise", amax_reduction_group=None):
            pass

    with pytest.raises(RuntimeError, match="parallel.overlap_moe_comm=false"):
        overlap.run_pair(lambda: Exchange([_Done()], what="ep test").wait(), forward)
    assert te._REGION["depth"] == 0
    with fp8_region("tensorwise", amax_reduction_group=None):  # outside a pair (warm-up forwards): fine
        assert te._REGION["depth"] == 1


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "mxfp8"])
def test_te_fp8_with_overlap_is_refused_naming_both_keys(recipe):
    overrides = ["moe.expert_backend=te", f"moe.fp8_recipe={recipe}", "parallel.overlap_moe_comm=true"]
    with pytest.raises(ConfigError) as err:
        validate_job(job(*overrides), world_size=1)
    msg = str(err.value)
    assert "parallel.overlap_moe_comm" in msg and "moe.expert_backend='te'" in msg, msg
    assert "parallel.overlap_moe_comm=false" in msg and "moe.expert_backend=torch" in msg, msg  # the fixes
    validate_job(job(*overrides[:2]), world_size=1)  # without overlap: accepted
    validate_job(job("moe.expert_backend=te", "parallel.overlap_moe_comm=true"), world_size=1)  # BF16: no region


def test_auto_resolving_to_te_on_the_device_is_refused_too(monkeypatch):
    import folding.job.validate as validate

    monkeypatch.setattr(validate, "resolve_expert_backend", lambda *a, **k: "te")  # a GPU where TE runs the recipe
    j = job("moe.fp8_recipe=tensorwise", "parallel.overlap_moe_comm=true")
    with pytest.raises(ConfigError, match=r"moe.expert_backend='auto' \(te on cuda:0\)"):
        validate_job(j, world_size=1, device=torch.device("cuda", 0))
    monkeypatch.setattr(validate, "resolve_expert_backend", lambda *a, **k: "torch")
    validate_job(j, world_size=1, device=torch.device("cuda", 0))
