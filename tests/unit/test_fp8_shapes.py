"""FP8 recipes' shape rules and the backend-dependent recompute check, at configuration time.

MXFP8 needs every expert GEMM dimension (``H``, ``F/etp``, ``2·F/etp``) divisible by 32, the FP8
recipes by 16 (the numbers TE 2.20.2 records, see test_te_snapshot.py); ``delayed`` with activation
recompute is rejected when the experts will run TE, including when ``moe.expert_backend=auto``
resolves to it on the training device.
"""

import pytest
import torch

import folding.moe.experts.select as select_mod
import folding.moe.experts.te as te_mod
from folding.job.config import ConfigError
from folding.job.validate import expert_backend_on, validate_job
from folding.launch.dry_run import dry_run_report
from folding.moe.experts.fp8_shapes import check_fp8_shapes, fp8_shape_problems
from tests import te_standin
from tests.unit.test_config_job import job


def test_mxfp8_needs_32_and_fp8_16_on_every_expert_dimension():
    assert fp8_shape_problems("mxfp8", hidden_size=4096, ffn_hidden_size=14336, etp=1) == []
    assert fp8_shape_problems("mxfp8", hidden_size=4096, ffn_hidden_size=14336, etp=4) == []  # 3584 = 112*32
    assert fp8_shape_problems("mxfp8", hidden_size=4096, ffn_hidden_size=1536, etp=16) == []  # 96 = 3*32
    assert fp8_shape_problems("mxfp8", hidden_size=4080, ffn_hidden_size=96, etp=2) == [
        "model.hidden_size=4080",
        "moe.ffn_hidden_size/parallel.etp = 96/2 = 48",
    ]
    assert fp8_shape_problems("delayed", hidden_size=4080, ffn_hidden_size=96, etp=2) == []  # both fine for 16
    assert fp8_shape_problems("rowwise", hidden_size=64, ffn_hidden_size=96, etp=4) == [
        "moe.ffn_hidden_size/parallel.etp = 96/4 = 24"
    ]
    assert fp8_shape_problems(None, hidden_size=7, ffn_hidden_size=7, etp=1) == []


def test_the_error_names_the_keys_and_a_fix():
    with pytest.raises(ValueError) as err:
        check_fp8_shapes("mxfp8", hidden_size=64, ffn_hidden_size=96, etp=2)
    msg = str(err.value)
    assert "moe.fp8_recipe='mxfp8'" in msg and "divisible by 32" in msg
    assert "moe.ffn_hidden_size/parallel.etp = 96/2 = 48" in msg and "parallel.etp among [1, 3]" in msg
    with pytest.raises(ValueError, match=r"model.hidden_size=48 is not: set model.hidden_size to a multiple of 32"):
        check_fp8_shapes("mxfp8", hidden_size=48, ffn_hidden_size=96, etp=1)
    check_fp8_shapes("mxfp8", hidden_size=48, ffn_hidden_size=96, etp=1, backend="emulated")  # any shape


@pytest.mark.parametrize(
    "overrides,world,key",
    [
        (["moe.fp8_recipe=mxfp8", "model.hidden_size=48"], 1, "model.hidden_size=48"),
        (["moe.fp8_recipe=mxfp8", "parallel.etp=2"], 2, "moe.ffn_hidden_size/parallel.etp = 96/2 = 48"),
        (["moe.fp8_recipe=tensorwise", "moe.ffn_hidden_size=72"], 1, "moe.ffn_hidden_size/parallel.etp = 72/1 = 72"),
        (["moe.fp8_recipe=mxfp8", "moe.expert_backend=te", "model.hidden_size=80"], 1, "model.hidden_size=80"),
    ],
)
def test_bad_expert_shapes_are_rejected_at_config_time(overrides, world, key):
    with pytest.raises(ConfigError, match=key.replace("*", r"\*").replace(".", r"\.")):
        validate_job(job(*overrides), world_size=world)
    with pytest.raises(ConfigError, match="divisible by"):
        dry_run_report(job(*overrides), world_size=world)


def test_good_shapes_and_emulation_pass():
    validate_job(job("moe.fp8_recipe=mxfp8"), world_size=1)  # mixtral_tiny: H=64, F=96
    validate_job(job("moe.fp8_recipe=mxfp8", "moe.expert_backend=emulated", "parallel.etp=2"), world_size=2)


@pytest.fixture
def te_present(monkeypatch):
    """TE (the stand-in) answers its own support checks, as on a GPU that has it."""
    te_standin.install(monkeypatch)
    monkeypatch.setattr(select_mod, "te_available", lambda: (True, ""))
    monkeypatch.setattr(te_mod, "te_available", lambda: (True, ""))


def test_delayed_recompute_is_rejected_on_the_resolved_backend(te_present):
    cuda = torch.device("cuda", 0)
    bad = job("train.recompute=moe", "moe.fp8_recipe=delayed")  # expert_backend=auto
    assert expert_backend_on(bad, cuda) == "te" and expert_backend_on(bad, None) == "auto"
    with pytest.raises(ConfigError, match=r"train\.recompute.*moe\.expert_backend='auto' \(te on cuda:0\)"):
        validate_job(bad, world_size=1, device=cuda)
    validate_job(bad, world_size=1, device=torch.device("cpu"))  # auto runs emulated here: no FP8 region
    validate_job(job("train.recompute=selective", "moe.fp8_recipe=delayed"), world_size=1, device=cuda)
    te_standin.SUPPORT["is_fp8_available"] = (False, "Device compute capability 8.9 or higher required")
    validate_job(bad, world_size=1, device=cuda)  # auto falls back to emulated on this GPU
    with pytest.raises(ConfigError, match=r"train\.recompute.*moe\.expert_backend='te'"):
        validate_job(job("train.recompute=full", "moe.fp8_recipe=delayed", "moe.expert_backend=te"), world_size=1)
