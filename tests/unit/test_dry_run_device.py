"""The dry run knows the GPU's memory: ``parallel.gpu`` (else this machine's CUDA device, matched to a kind
of the planner's table) and refuses a job whose predicted peak does not fit, with one ``error:`` line and
exit status 2 that name the stages over, their peaks, the GPU's memory and the ranked ``train.recompute``
changes of :func:`folding.planning.suggestions.memory_suggestions`."""

import math
import os
import re

import pytest
import torch

from folding.job.compose import compose_tree
from folding.job.config import job_config_from_dict
from folding.job.machine import cuda_device_here
from folding.job.validate import validate_job
from folding.launch import cli, device_memory
from folding.planning.hardware import GIB, OUTSIDE_ALLOCATOR_GIB, device_gpu, get_gpu
from folding.planning.job_memory import job_memory, stage_memories
from folding.planning.suggestions import memory_suggestions

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
# Mixtral 8x7B on 64 ranks under plain 1F1B (PP4), micro-batch 2: stage 0 keeps 4 micro-batches in flight
# (79.9 GiB), stage 1 three (64.3 GiB), stages 2 and 3 fewer; an h100 holds 72.0 / 1.05 = 68.6 GiB.
STRADDLE = ["recipes=mixtral_8x7b", "parallel.vpp=null", "train.micro_batch_size=2"]


@pytest.fixture(autouse=True)
def _schema(monkeypatch):
    from folding.job.schema import register_schema

    register_schema()
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")


def _job(*overrides):
    return job_config_from_dict(compose_tree(list(overrides), config_dir=CONFIGS, config_name="config"))


def _check(args, capsys):
    status = cli.check_command_line(list(args), config_dir=CONFIGS, world_size=1)
    out = capsys.readouterr()
    return status, out.out, out.err


def test_cuda_devices_are_matched_to_the_table_by_name_and_memory():
    # the totals nvidia-smi reports (81559, 143771, 183359 MiB), about 6% above the datasheet's GB count
    assert device_gpu("NVIDIA H100 80GB HBM3", 81559 * 2**20) is get_gpu("h100")
    assert device_gpu("NVIDIA H200", 143771 * 2**20) is get_gpu("h200")
    assert device_gpu("NVIDIA B200", 183359 * 2**20) is get_gpu("b200")
    # an H100 NVL (94 GB) is not the 80 GB h100: its own memory, less what stays outside the allocator
    nvl = device_gpu("NVIDIA H100 NVL", 99_900_000_000)
    assert nvl.name == "NVIDIA H100 NVL"
    assert nvl.usable_memory_gib == pytest.approx(99.9e9 / GIB - OUTSIDE_ALLOCATOR_GIB)
    a100 = device_gpu("NVIDIA A100-SXM4-40GB", 42_298_834_944)
    assert not a100.fits(40 * GIB) and a100.fits(35 * GIB)
    # the table's capacities: the datasheet's 80 / 141 / 180 GB, less 2.5 GiB outside the allocator
    assert [round(get_gpu(g).usable_memory_gib, 1) for g in ("h100", "h200", "b200")] == [72.0, 128.8, 165.1]
    # this machine: a name and a byte count, or None without CUDA (never an error)
    here = cuda_device_here()
    assert here is None if not torch.cuda.is_available() else isinstance(here[1], int) and here[1] > 0


def test_a_job_over_the_gpu_is_refused_naming_the_stages_and_the_fixes(capsys):
    job = _job(*STRADDLE)
    layout = validate_job(job, world_size=64)
    peaks = [e.total for e in stage_memories(job, layout)]
    h100 = get_gpu("h100")
    assert [h100.fits(p) for p in peaks] == [False, True, True, True]
    status, out, err = _check([*STRADDLE, "parallel.gpu=h100", "train.dry_run=true"], capsys)
    assert status == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: parallel.gpu=h100: the predicted peak per rank does not fit the h100 on pipeline ")
    assert f"stage 0 {peaks[0] / GIB:.1f} GiB (" in err and "stage 1 " not in err  # only the stage over
    assert f"needs {peaks[0] * 1.05 / GIB:.1f} GiB with the 5% allocator overhead" in err
    assert "the h100's 80 GB leave 72.0 GiB to PyTorch's allocator" in err
    fixes = memory_suggestions(job, 0, layout=layout, gpu=h100)
    assert len(fixes) > 3  # the three cheapest are named
    assert "the three cheapest fixes, by GiB saved per second of step time: " + "; ".join(fixes[:3]) + "; or " in err
    # the same job fits an h200, and the report says against what it was checked
    status, out, err = _check([*STRADDLE, "parallel.gpu=h200", "train.dry_run=true"], capsys)
    assert status == 0, err
    assert f"device      parallel.gpu=h200: fits (stage 0 needs {peaks[0] * 1.05 / GIB:.1f} GiB" in out


def test_memory_suggestions_rank_the_recompute_modules_by_bytes_per_second():
    job = _job(*STRADDLE)
    layout = validate_job(job, world_size=64)
    h100 = get_gpu("h100")
    fixes = memory_suggestions(job, 0, layout=layout, gpu=h100)
    # Mixtral has no MLA, no dense MLP and no shared expert: those modules save nothing and are left out;
    # so is offloading attn_proj alone (its input is the attention core's output, which the core keeps too)
    assert sorted(f.split(": ")[0] for f in fixes) == [
        "train.offload_modules=[attn_norm]",
        "train.offload_modules=[core_attn]",
        "train.offload_modules=[expert_fc1]",
        "train.offload_modules=[mlp_norm]",
        "train.offload_modules=[moe_act]",
        "train.offload_modules=[qkv_linear]",
        "train.recompute=full",
        "train.recompute_modules=[core_attn]",
        "train.recompute_modules=[layernorm]",
        "train.recompute_modules=[moe]",
        "train.recompute_modules=[moe_act]",
    ]
    before = job_memory(job, layout, stage=0).total
    rates = []  # (fits, GiB per second)
    for line in fixes:
        after = job_memory(_job(*STRADDLE, line.split(": ")[0]), layout, stage=0).total
        assert f": {(before - after) / GIB:.1f} GiB less on stage 0 ({after / GIB:.1f} GiB, " in line
        assert ("fits the h100" in line) == h100.fits(after)
        cost = re.search(r"for \+([0-9.]+) s per step \(([0-9]+) GiB per second\)", line)
        fits = h100.fits(after)
        if cost is None:  # an offload module whose copies the layers' compute hides
            assert line.endswith("at no extra step time"), line
            rates.append((fits, math.inf))
            continue
        seconds = float(cost.group(1))
        assert seconds > 0
        rates.append((fits, (before - after) / GIB / seconds))
    # the changes that make the stage fit first, then the others, each from the most GiB per second down
    assert rates == sorted(rates, key=lambda r: (not r[0], -r[1])) and rates[0][0]
    # recomputing everything already: nothing left to suggest
    assert memory_suggestions(_job(*STRADDLE, "train.recompute=full"), 0, layout=layout) == []


def test_null_gpu_checks_this_machines_device_and_nothing_without_one(capsys, monkeypatch):
    monkeypatch.setattr(device_memory, "cuda_device_here", lambda: ("NVIDIA H100 80GB HBM3", 85_031_714_816))
    status, out, err = _check([*STRADDLE, "train.dry_run=true"], capsys)
    assert status == 2
    assert err.startswith("error: parallel.gpu=null: this machine's NVIDIA H100 80GB HBM3, the h100 of the table: ")
    monkeypatch.setattr(device_memory, "cuda_device_here", lambda: None)
    status, out, err = _check([*STRADDLE, "train.dry_run=true"], capsys)
    assert status == 0, err
    assert "device      parallel.gpu=null and no CUDA device on this machine: memory not checked" in out


def test_an_unknown_gpu_kind_is_a_config_error(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for args in (["parallel.gpu=a100", "train.dry_run=true"], ["parallel.gpu=a100", "train.steps=2"]):
        status, out, err = _check(args, capsys)
        assert status == 2
        assert err == (
            "error: parallel.gpu='a100': unknown GPU kind; choose one of b200, h100, h200, or null "
            "(this machine's CUDA device)\n"
        )
    assert _check(["parallel.gpu=H200", "train.steps=2"], capsys)[0] is None  # a kind, any case


def test_the_dry_run_prints_the_precision_it_assumes(capsys):
    status, out, _ = _check(["recipes=mixtral_8x7b", "optim.exp_avg_dtype=bf16", "train.dry_run=true"], capsys)
    assert status == 0
    assert (
        "precision   parameters bf16 (routers fp32), activations bf16, main grads fp32, master weights fp32 copy, "
        "AdamW exp_avg bf16, exp_avg_sq fp32 (train.precision=bf16, optim.*)"
    ) in out
    status, out, _ = _check(["train.precision=fp32", "train.dry_run=true"], capsys)
    assert "precision   parameters fp32, activations fp32, main grads fp32, master weights fp32 (the parameters" in out


def test_a_run_that_names_a_gpu_it_does_not_fit_is_refused_before_any_process_group(capsys):
    """Not only the dry run: the launch itself refuses the job before ``torch.distributed`` starts, and the
    same job on a GPU it fits, or with no GPU named, goes on to Hydra (``None``)."""
    import torch.distributed as dist

    def launch(*extra):
        status = cli.check_command_line([*STRADDLE, *extra], config_dir=CONFIGS, world_size=64)
        return status, capsys.readouterr().err

    status, err = launch("parallel.gpu=h100")
    assert status == 2 and err.startswith("error: parallel.gpu=h100: the predicted peak per rank does not fit")
    assert not dist.is_initialized()
    assert launch("parallel.gpu=h200") == (None, "")
    assert launch() == (None, "")
