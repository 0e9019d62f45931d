"""Backend × FP8 recipe selection and the job's machine check for the ``torch`` FP8 path.

The GPU is simulated (``torch.cuda.is_available`` / ``get_device_capability`` and the kernel probe
patched): the rules, reasons and fixes are checked on CPU; the kernels themselves are not run here.
"""

import pytest
import torch

import folding.moe.experts.scaled as scaled_mod
import folding.moe.experts.select as select_mod
from folding.moe.experts.select import BackendError, backend_support, check_backend, resolve_backend


# ------------------------------------------------------------------------------- backend selection
def _gpu(monkeypatch, capability, probe=(True, "")):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(scaled_mod, "_probe", lambda recipe, index: probe)
    monkeypatch.setattr(select_mod, "te_available", lambda: (False, "transformer_engine is not installed"))


def test_torch_fp8_support_by_compute_capability(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    ok, why = backend_support("torch", "rowwise", cpu)
    assert not ok and "compute capability 9.x" in why and "no CUDA device" in why
    _gpu(monkeypatch, (9, 0))
    assert backend_support("torch", "rowwise", cuda, torch.bfloat16) == (True, "")
    ok, why = backend_support("torch", "mxfp8", cuda, torch.bfloat16)
    assert not ok and "10.x" in why and "9.0" in why
    ok, why = backend_support("torch", "rowwise", cuda, torch.float32)
    assert not ok and "bfloat16" in why
    ok, why = backend_support("torch", "blockwise", cuda, torch.bfloat16)
    assert not ok and "rowwise, mxfp8" in why
    _gpu(monkeypatch, (10, 0))
    assert backend_support("torch", "mxfp8", cuda, torch.bfloat16) == (True, "")
    assert not backend_support("torch", "rowwise", cuda, torch.bfloat16)[0]
    _gpu(monkeypatch, (9, 0), probe=(False, "torch._scaled_grouped_mm failed on this GPU (RuntimeError: x)"))
    with pytest.raises(BackendError, match="failed on this GPU.*moe.expert_backend=emulated"):
        check_backend("torch", "rowwise", cuda, torch.bfloat16)


def test_te_has_no_rowwise_recipe():
    ok, why = backend_support("te", "rowwise", torch.device("cuda", 0))
    assert not ok and "no rowwise recipe" in why
    with pytest.raises(BackendError, match="moe.fp8_recipe='rowwise'.*no rowwise recipe.*moe.expert_backend=torch"):
        check_backend("te", "rowwise", torch.device("cuda", 0))


def test_auto_prefers_te_then_the_torch_fp8_path_then_emulated(monkeypatch, recwarn):
    cuda = torch.device("cuda", 0)
    _gpu(monkeypatch, (9, 0))
    assert resolve_backend("auto", "rowwise", cuda, torch.bfloat16) == "torch"
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]  # not a fallback
    with pytest.warns(RuntimeWarning, match="runs the emulated backend.*not installed.*10.x"):
        assert resolve_backend("auto", "mxfp8", cuda, torch.bfloat16) == "emulated"
    monkeypatch.setattr(select_mod, "te_available", lambda: (True, ""))
    monkeypatch.setattr(select_mod, "te_recipe_support", lambda recipe: (True, ""))
    assert resolve_backend("auto", "mxfp8", cuda, torch.bfloat16) == "te"  # TE first where it runs
    assert resolve_backend("auto", "rowwise", cuda, torch.bfloat16) == "torch"  # TE has no rowwise


# ----------------------------------------------------------------------- the job, on this machine
@pytest.fixture
def entry(monkeypatch, capsys):
    from folding.job.schema import register_schema
    from folding.launch import cli

    register_schema()
    configs = __file__.rsplit("/tests/", 1)[0] + "/configs"
    monkeypatch.setenv("LOCAL_RANK", "0")

    def check(*args):
        status = cli.check_command_line(list(args), config_dir=configs, world_size=1)
        return status, capsys.readouterr()

    return check


ROWWISE = ("moe.fp8_recipe=rowwise", "moe.expert_backend=torch", "train.precision=bf16")


def test_job_with_torch_rowwise_is_refused_without_the_kernel(entry):
    status, out = entry(*ROWWISE)
    assert status == 2 and out.err.count("\n") == 1
    for part in (
        "moe.expert_backend='torch'",
        "moe.fp8_recipe='rowwise'",
        "compute capability 9.x",
        "no CUDA device",
        "moe.expert_backend=emulated",
    ):
        assert part in out.err, out.err
    status, out = entry(*ROWWISE, "train.dry_run=true")  # a dry run reports it and still plans
    assert status == 0 and "moe.fp8_recipe=rowwise; on this machine (cpu) it cannot run" in out.out
    assert entry("moe.fp8_recipe=rowwise", "moe.expert_backend=emulated")[0] is None


def test_job_with_torch_rowwise_is_accepted_on_a_hopper_gpu(entry, monkeypatch):
    _gpu(monkeypatch, (9, 0))
    status, out = entry(*ROWWISE)
    assert status is None, out.err
    status, out = entry("moe.fp8_recipe=rowwise", "moe.expert_backend=torch")  # fp32 compute
    assert status == 2 and "train.precision=bf16" in out.err
    _gpu(monkeypatch, (8, 0))
    status, out = entry(*ROWWISE)
    assert status == 2 and "this GPU is 8.0" in out.err
