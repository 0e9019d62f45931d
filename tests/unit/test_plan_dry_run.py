"""A plan's ``run:`` overrides, dry-run as written, report the plan's memory: the planner's Python API picks
plans for a few models, worlds, GPUs and settings (micro-batch 2, bf16 moments, Muon, overlap, uneven
stages, recompute, hierarchical dispatch, FP8 experts, a world smaller than a node, the recompute and offload
modules that make a layout fit), and the entry point's own check (:func:`folding.launch.cli.check_command_line`,
what ``python examples/pretrain_mixtral.py <overrides> train.dry_run=true`` runs) prints a per-rank peak within
1% of the plan's, checked against the plan's GPU.
Without the settings the plan assumed (the ``run:`` line as it was) the same layout predicts far more."""

import functools
import os
import re
from dataclasses import replace

import pytest

from folding.job.compose import compose_tree
from folding.job.config import job_config_from_dict
from folding.job.validate import validate_job
from folding.launch import cli, device_memory
from folding.model.presets import get_preset
from folding.planning.hardware import GIB, get_gpu
from folding.planning.job_memory import job_memory
from folding.planning.optim_precision import OptimizerPrecision
from folding.planning.planner import cheapest_fit, enumerate_plans, evaluate, plan_layouts
from folding.planning.step_time import Cluster, TrainingShape

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
MEMORY = re.compile(r"memory +([0-9.]+) GiB per rank on stage (\d+)")


@pytest.fixture(autouse=True)
def _schema(monkeypatch):
    from folding.job.schema import register_schema

    register_schema()
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")


def _dry_run(overrides, capsys):
    """The entry point's dry run of ``overrides`` on this (CPU) machine: (exit status, stdout, stderr)."""
    status = cli.check_command_line([*overrides, "train.dry_run=true"], config_dir=CONFIGS, world_size=1)
    out = capsys.readouterr()
    return status, out.out, out.err


def _planned(model, world, gpu, *, pick=0, nvlink_domain=8, **shape):
    cfg = get_preset(model)
    cluster = Cluster(gpu=get_gpu(gpu), num_gpus=world, nvlink_domain=nvlink_domain)
    return plan_layouts(cfg, cluster=cluster, shape=TrainingShape(seq_length=4096, global_batch_size=256, **shape))


@functools.lru_cache(maxsize=None)
def _cases():
    """``{name: PlanResult}`` of the plans the test dry-runs, from the planner's API (made once, when the
    first test asks)."""
    out = []
    best = _planned("mixtral_8x7b", 16, "h100")
    out += [("mixtral_8x7b best", best[0]), ("mixtral_8x7b second", best[1])]
    bf16 = OptimizerPrecision(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    q2 = _planned("qwen2_57b_a14b", 32, "h200", micro_batch_size=2, optim_precision=bf16)
    out.append(("qwen2_57b_a14b mbs2 bf16 moments on h200", q2[0]))
    muon = OptimizerPrecision(name="muon", main_grads_dtype="bf16")
    q3 = plan_layouts(
        get_preset("qwen3_30b_a3b"),
        cluster=Cluster(gpu=get_gpu("h100"), num_gpus=16),
        shape=TrainingShape(seq_length=4096, global_batch_size=256, optim_precision=muon),
        overlap_moe_comm=True,
        dispatcher="hierarchical",
    )
    out.append(("qwen3_30b_a3b muon overlap hierarchical", q3[0]))
    # an uneven pipeline split with selective recompute and FP8 experts, evaluated on its own
    cfg = get_preset("qwen2_57b_a14b")  # 28 layers on PP8
    cluster = Cluster(gpu=get_gpu("b200"), num_gpus=64)
    shape = TrainingShape(seq_length=4096, global_batch_size=256, fp8_recipe="blockwise")
    plan = next(
        p
        for p in enumerate_plans(cfg, cluster=cluster, shape=shape)
        if p.pp == 8 and p.first_stage_layers and p.recompute == "selective" and (p.tp, p.ep, p.etp) == (2, 8, 1)
    )
    out.append(("qwen2_57b_a14b uneven selective fp8", evaluate(cfg, plan, cluster=cluster, shape=shape)))
    # a world smaller than one node of --nvlink-domain 8 (the run: line says a node of 4)
    tiny = plan_layouts(
        get_preset("mixtral_tiny"),
        cluster=Cluster(gpu=get_gpu("h100"), num_gpus=4),
        shape=TrainingShape(seq_length=64, global_batch_size=16, micro_batch_size=2),
        dispatcher="hierarchical",
    )
    out.append(("mixtral_tiny on 4 hierarchical", next(r for r in tiny if r.plan.ep == 4)))
    out.append(("deepseek_v3 recompute and offload modules", _deepseek_v3_modules()))
    return dict(out)


def _deepseek_v3_modules():
    """DeepSeek-V3 on 1,024 H100, TP2 PP16 (a one-layer last stage) EP8: of the modes only ``full`` fits; the
    fastest modules that fit (``--memory-gib``, :func:`cheapest_fit`) recompute ``layernorm`` and
    ``mla_up_proj`` and offload ``expert_fc1``."""
    cfg = get_preset("deepseek_v3")
    cluster = Cluster(gpu=get_gpu("h100"), num_gpus=1024)
    shape = TrainingShape(seq_length=4096, global_batch_size=8192)
    sizes = (2, 1, 16, 8, 1, 1, 1, True, "none")
    plan = next(
        p
        for p in enumerate_plans(cfg, cluster=cluster, shape=shape)
        if (p.tp, p.cp, p.pp, p.ep, p.etp, p.vpp, p.last_stage_layers, p.distributed_optimizer, p.recompute) == sizes
    )
    return cheapest_fit(cfg, plan, cluster=cluster, shape=shape)


CASES = [
    "mixtral_8x7b best",
    "mixtral_8x7b second",
    "qwen2_57b_a14b mbs2 bf16 moments on h200",
    "qwen3_30b_a3b muon overlap hierarchical",
    "qwen2_57b_a14b uneven selective fp8",
    "mixtral_tiny on 4 hierarchical",
    "deepseek_v3 recompute and offload modules",
]


@pytest.mark.parametrize("name", CASES)
def test_run_line_dry_runs_to_the_plans_memory(name, capsys):
    result = _cases()[name]
    over = result.overrides
    assert over[0] == f"model={result.cfg.name}" and f"parallel.world_size={result.cluster.num_gpus}" in over
    for key in ("train.precision=bf16", "train.micro_batch_size=", "parallel.gpu=", "parallel.nvlink_domain="):
        assert any(o.startswith(key) for o in over), (key, over)
    status, out, err = _dry_run(over, capsys)
    assert status == 0, err
    printed = MEMORY.search(out)
    assert printed, out
    plan_gib = result.memory.total / GIB
    # the report prints one decimal: within 1% of the plan, and within its rounding
    assert abs(float(printed.group(1)) - plan_gib) <= max(0.01 * plan_gib, 0.05), (out, plan_gib)
    assert int(printed.group(2)) == result.memory.stage
    assert f"parallel.gpu={result.cluster.gpu.name}: fits" in out
    # the estimate behind the report, unrounded: the same model with the same settings
    job = job_config_from_dict(compose_tree(over, config_dir=CONFIGS, config_name="config"))
    dry = job_memory(job, validate_job(job, world_size=result.cluster.num_gpus))
    assert abs(dry.total - result.memory.total) <= 0.01 * result.memory.total, (dry, result.memory)
    assert "precision   parameters bf16 (routers fp32), activations bf16" in out


def test_the_modules_plan_fits_where_no_mode_but_full_does():
    """The DeepSeek-V3 case's run: line names its modules, and it is faster than ``full``, the one mode that
    fits that layout."""
    result = _cases()["deepseek_v3 recompute and offload modules"]
    assert (result.plan.recompute, result.plan.offload) == ("layernorm,mla_up_proj", "expert_fc1")
    over = result.overrides
    assert "train.recompute=none" in over and "train.recompute_modules=[layernorm,mla_up_proj]" in over
    assert "train.offload_modules=[expert_fc1]" in over
    for mode in ("none", "selective", "moe", "full"):
        plain = evaluate(
            result.cfg, replace(result.plan, recompute=mode, offload=""), cluster=result.cluster, shape=result.shape
        )
        assert result.cluster.gpu.fits(plain.memory.total) == (mode == "full"), mode
        if mode == "full":
            assert result.time.step_s < 0.8 * plain.time.step_s


def test_the_old_run_line_predicts_another_memory(capsys, monkeypatch):
    """The layout overrides alone (the ``run:`` line before it carried the plan's assumptions) run the
    config's defaults: fp32 and micro-batch 2, far more than the plan's memory; unchecked without
    ``parallel.gpu`` on a machine without CUDA, refused on the plan's GPU."""
    monkeypatch.setattr(device_memory, "cuda_device_here", lambda: None)  # as on a CPU machine
    result = _cases()[CASES[0]]
    layout_only = [o for o in result.overrides if o.startswith(("model=", "parallel.", "optim.distributed"))]
    layout_only = [o for o in layout_only if not o.startswith("parallel.gpu=")]
    layout_only += ["train.seq_length=4096", "train.global_batch_size=256", f"train.recompute={result.plan.recompute}"]
    status, out, err = _dry_run(layout_only, capsys)
    assert status == 0, err
    assert float(MEMORY.search(out).group(1)) > 1.5 * result.memory.total / GIB
    assert "parameters fp32, activations fp32" in out and "micro-batch 2," in out
    status, out, err = _dry_run([*layout_only, "parallel.gpu=h100"], capsys)
    assert status == 2 and err.startswith("error: parallel.gpu=h100: the predicted peak per rank does not fit")
