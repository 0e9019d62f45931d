"""Hot-expert replicas are visible: a 4-rank EP4 run re-planning every 2 steps logs each re-plan (which
experts got copies on which EP ranks, the EP ranks' max/mean load before and after) in ``train.log`` and
as a ``replan`` record of ``metrics.jsonl``; every ``train`` record carries the slot tables in use; and
``tools.plot_run`` finds the re-plans to mark them."""

import json
import os

import torch.distributed as dist

from folding.training.telemetry.replica_log import replan_message
from tests.distributed.test_checkpoint_reshard import _job

STEPS, INTERVAL, R, EP = 5, 2, 2, 4


def _train(run_dir):
    from folding.launch.run_dir import RunLog
    from folding.training import trainer

    job = _job(dict(ep=EP, etp=1), False, steps=STEPS, moe=dict(expert_replicas=R, replica_interval=INTERVAL))
    log = RunLog(run_dir) if dist.get_rank() == 0 else None
    try:
        trainer.train(job, run_dir=run_dir, run_log=log)
    finally:
        if log is not None:
            log.close()


def test_replans_are_logged_and_summarized_per_step(ranks, tmp_path):
    from tools.plot_run import plot, read_records, replan_steps

    ranks(4).run(_train, str(tmp_path))
    recs = read_records(str(tmp_path))
    train = [r for r in recs if r["kind"] == "train"]
    replans = [r for r in recs if r["kind"] == "replan"]
    layers = sorted({s["layer"] for r in train for s in r["replicas"]})
    assert len(train) == STEPS and layers
    # one re-plan per layer at steps 2 and 4
    assert sorted((r["step"], r["layer"]) for r in replans) == [(s, n) for s in (2, 4) for n in layers]
    log = open(tmp_path / "train.log").read().splitlines()
    for r in replans:
        assert r["message"] == replan_message(r["step"], r) and r["message"] in log
        assert r["message"].startswith(f"replicas re-planned at step {r['step']}, layer {r['layer']}: ")
        before, after = r["before"], r["after"]
        assert after["max_over_mean"] <= before["max_over_mean"]  # the planner never makes the peak worse
        for e, held in after["copies"].items():  # copies on EP ranks that do not own the expert
            assert int(e) // (8 // EP) not in held and all(0 <= x < EP for x in held)
            assert f"expert {e} on EP rank" in r["message"]
        assert f"{before['max_over_mean']:.2f} -> {after['max_over_mean']:.2f}" in r["message"]
    # the per-step summary: the table each step ran with, the one installed by the last re-plan
    installed = {n: [-1] * (EP * R) for n in layers}
    for rec in train:
        for s in rec["replicas"]:
            assert len(s["table"]) == EP * R and s["table"] == installed[s["layer"]], (rec["step"], s)
            assert s["max_over_mean"] >= 1.0 and s["max_over_mean_without"] >= 1.0
            if all(e == -1 for e in s["table"]):
                assert s["max_over_mean"] == s["max_over_mean_without"] and s["copies"] == {}
        for r in replans:
            if r["step"] == rec["step"]:
                installed[r["layer"]] = r["after"]["table"]
    assert any(e != -1 for r in replans for e in r["after"]["table"])  # some expert did get a copy
    assert replan_steps(recs) == [2, 4]
    out = plot(recs, str(tmp_path / "run.png"))
    assert os.path.getsize(out) > 0
    json.dumps(recs)  # every record stays plain JSON
