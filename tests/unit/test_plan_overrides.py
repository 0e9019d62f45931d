"""A plan turns into a job: ``tools.plan`` prints under each listed plan the overrides that run it as
planned (model, world, GPU, node size, layout, optimizer dtypes, precision, sequence, batch sizes, recompute),
and the precision it assumes; its ``--json`` holds them as ``overrides`` (``--top`` applies there too, and
``ep_placement`` is the one field saying where EP sits), and the first plan's overrides, dry-run as written,
give the planned layout and memory on the planned world size and GPU (tests/unit/test_plan_dry_run.py checks
the memory of more plans through the Python API)."""

import json
import os
import re
import subprocess
import sys

from folding.planning.planner import plan_overrides
from folding.planning.step_time import Plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAN = ["--model", "mixtral_8x7b", "--world", "64", "--seq-length", "4096", "--global-batch-size", "256"]


def _run(*args):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)


def test_plans_print_and_list_the_overrides_that_run_them():
    text = _run("-m", "tools.plan", *PLAN, "--top", "3")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    plans = [i for i, line in enumerate(lines) if line.lstrip().split("  ")[0] in ("1", "2", "3")]
    assert len(plans) == 3, text.stdout
    assert lines[1] == (
        "precision: parameters bf16 (routers fp32), activations bf16, main grads fp32, master weights fp32 copy, "
        "AdamW exp_avg fp32, exp_avg_sq fp32"
    )
    for i in plans:  # the line under each plan runs it
        run = lines[i + 1].split()
        assert run[:5] == [
            "run:",
            "model=mixtral_8x7b",
            "parallel.world_size=64",
            "parallel.gpu=h100",
            "parallel.nvlink_domain=8",
        ]
        assert run[-5:-1] == [
            "train.precision=bf16",
            "train.seq_length=4096",
            "train.global_batch_size=256",
            "train.micro_batch_size=1",
        ]
        assert run[-1].startswith("train.recompute=") and any(t.startswith("optim.distributed=") for t in run)
        assert "optim.name=adamw" in run and "optim.exp_avg_dtype=fp32" in run and "optim.main_grads_dtype=fp32" in run

    out = _run("-m", "tools.plan", *PLAN, "--top", "3", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert len(rows) == 3
    for row in rows:
        assert "folded" not in row and row["ep_placement"] in ("in_dp", "folded", None)
        assert isinstance(row["overrides"], list) and all(isinstance(o, str) for o in row["overrides"])
        for key in ("tp", "cp", "pp", "ep", "etp"):
            assert f"parallel.{key}={row[key]}" in row["overrides"]
        assert f"train.recompute={row['recompute']}" in row["overrides"]
    # the text's override line is the JSON's list
    assert lines[plans[0] + 1].split()[1:] == rows[0]["overrides"]

    # the run: line as written (no other setting) is the planned job
    dry = _run(os.path.join(ROOT, "examples", "pretrain_mixtral.py"), *rows[0]["overrides"], "train.dry_run=true")
    assert dry.returncode == 0, dry.stderr
    assert "dry run: mixtral_8x7b on 64 ranks" in dry.stdout
    p = rows[0]
    vpp = f" VPP{p['vpp']}" if p["vpp"] > 1 else ""
    assert f"attention TP{p['tp']} CP{p['cp']} DP{p['dp']} PP{p['pp']}{vpp}" in dry.stdout, dry.stdout
    printed = re.search(r"memory +([0-9.]+) GiB per rank", dry.stdout).group(1)
    assert abs(float(printed) - p["memory_gib"]) <= 0.06, (p["memory_gib"], dry.stdout)  # one decimal vs two
    assert "device      parallel.gpu=h100: fits" in dry.stdout


def test_run_lines_carry_the_model_options(capsys):
    """``--moe``, ``--dispatcher`` and ``--fp8-recipe`` reach the run: line once each, after the plan's own
    settings, and the precision line says what has no job setting."""
    from tools.plan import main

    args = [*PLAN[:2], "--world", "16", *PLAN[4:], "--top", "1", "--moe", "capacity_factor=1.0"]
    args += ["--moe", "dispatcher=alltoall", "--dispatcher", "hierarchical"]  # the plan's dispatcher wins
    assert main([*args, "--fp8-recipe", "blockwise", "--fp8-dense"]) == 0
    lines = capsys.readouterr().out.splitlines()
    run = next(line for line in lines if line.lstrip().startswith("run:")).split()
    assert run[-3:] == ["moe.dispatcher=hierarchical", "moe.fp8_recipe=blockwise", "moe.capacity_factor=1.0"]
    assert run.count("train.precision=bf16") == 1 and sum(t.startswith("moe.dispatcher=") for t in run) == 1
    assert lines[1].endswith(
        "--fp8-dense has no job setting (folding's dense layers are bf16): the run: lines run them in bf16"
    )


def test_overrides_of_uneven_stages_overlap_and_an_unplaceable_unfolded_plan():
    base = dict(tp=2, cp=1, pp=4, vpp=1, ep=4, etp=1, dp=2, edp=4, distributed_optimizer=False, recompute="full")
    uneven = Plan(**base, first_stage_layers=3, last_stage_layers=2, overlap_moe_comm=True)
    assert plan_overrides(uneven) == [
        "parallel.tp=2",
        "parallel.cp=1",
        "parallel.pp=4",
        "parallel.ep=4",
        "parallel.etp=1",
        "parallel.first_stage_layers=3",
        "parallel.last_stage_layers=2",
        "parallel.overlap_moe_comm=true",
        "optim.distributed=false",
        "train.recompute=full",
    ]
    # Megatron-Core without folding, CP2: EP carved out of DP at stride TP·CP, which no engine layout has
    assert plan_overrides(Plan(**{**base, "cp": 2, "etp": 2, "dp": 1, "edp": 1}, folded=False)) is None
    assert plan_overrides(Plan(**{**base, "etp": 2, "edp": 2}, folded=False))[:5] == [
        "parallel.tp=2",
        "parallel.cp=1",
        "parallel.pp=4",
        "parallel.ep=4",
        "parallel.etp=2",
    ]
