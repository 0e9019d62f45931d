"""A plan turns into a job: ``tools.plan`` prints under each listed plan the overrides that run it, its
``--json`` holds them as ``overrides`` (``--top`` applies there too, and ``ep_placement`` is the one field
saying where EP sits), and the first plan's overrides pass the job's dry run on the planned world size."""

import json
import os
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
    for i in plans:  # the line under each plan runs it
        run = lines[i + 1].split()
        assert run[0] == "run:" and run[1].startswith("parallel.tp=") and run[-1].startswith("train.recompute=")
        assert any(t.startswith("optim.distributed=") for t in run)

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

    job = ["model=mixtral_8x7b", *rows[0]["overrides"], "parallel.world_size=64", "train.seq_length=4096"]
    job += ["train.global_batch_size=256", "train.micro_batch_size=1", "train.dry_run=true"]
    dry = _run(os.path.join(ROOT, "examples", "pretrain_mixtral.py"), *job)
    assert dry.returncode == 0, dry.stderr
    assert "dry run: mixtral_8x7b on 64 ranks" in dry.stdout
    p = rows[0]
    vpp = f" VPP{p['vpp']}" if p["vpp"] > 1 else ""
    assert f"attention TP{p['tp']} CP{p['cp']} DP{p['dp']} PP{p['pp']}{vpp}" in dry.stdout, dry.stdout


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
