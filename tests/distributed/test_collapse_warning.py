"""The router-collapse warning fires through the trainer: a router forced to send every token to the
same two experts is named (its layer, the experts) once its streak reaches 5 steps, once per streak, in
the console/log line and as a ``warning`` record of the metrics file; the other layer is not named.
And it stays silent on the README's demo (the default job; one process gives the 4-rank command's
per-step loads, docs/routing.md).

The collapse is forced through the router's own selection-only expert bias (``moe.expert_bias=true``):
a forward pre-hook sets layer 1's bias to +100 on experts 3 and 5 before every forward, so every
token's top-2 is experts 3 and 5 (they take 100% of the layer's routed tokens) while the gate weights,
the probabilities and the rest of the model train as usual. Layer 0's bias moves by the normal update
rule (1e-3 per step) and its router stays balanced; the test checks that from the metrics too.
"""

import glob
import json
import os
import subprocess
import sys

import torch

from folding.data.config import DataConfig
from folding.job.config import JobConfig, LoggingConfig, TrainConfig, WandbConfig
from folding.model.presets import get_preset
from folding.moe.routing.router import Router
from folding.optim.config import OptimConfig
from folding.training.telemetry.collapse import COLLAPSE_SHARE, COLLAPSE_STEPS, CollapseWatch

STEPS = 8
HOT_LAYER, HOT_EXPERTS = 1, [3, 5]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _job(metrics_file):
    model = get_preset(
        "mixtral_tiny", hidden_size=32, num_layers=2, init_std=0.1, moe={"ffn_hidden_size": 16, "expert_bias": True}
    )
    return JobConfig(
        model=model,
        train=TrainConfig(steps=STEPS, global_batch_size=8, micro_batch_size=2, seq_length=16, eval_interval=0),
        optim=OptimConfig(lr=1e-3, warmup_steps=0, decay_style="constant"),
        data=DataConfig(),
        logging=LoggingConfig(metrics_file=metrics_file, console=False, wandb=WandbConfig(mode="disabled")),
    )


def _force_hot_expert(router, args):
    """Forward pre-hook: the router's expert bias favours HOT_EXPERTS by far (returns None: the inputs stay)."""
    with torch.no_grad():
        router.expert_bias.zero_()
        router.expert_bias[HOT_EXPERTS] = 100.0


def _train_collapsed(run_dir):
    from folding.launch.run_dir import RunLog
    from folding.training import trainer

    real = trainer._build_chunks

    def build(job, ps, device, **kw):
        chunks = real(job, ps, device, **kw)
        for m in chunks[0].modules():
            if isinstance(m, Router) and m.layer_number == HOT_LAYER:
                m.register_forward_pre_hook(_force_hot_expert)
        return chunks

    trainer._build_chunks = build
    log = RunLog(run_dir)
    try:
        trainer.train(_job(os.path.join(run_dir, "metrics.jsonl")), run_dir=run_dir, run_log=log)
    finally:
        trainer._build_chunks = real
        log.close()


def test_collapsed_router_is_named(ranks, tmp_path):
    ranks(1).run(_train_collapsed, str(tmp_path))
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    train = [r for r in recs if r["kind"] == "train"]
    assert len(train) == STEPS
    for r in train:  # the forced layer is collapsed on every step, layer 0 never is
        counts = r["expert_counts"]
        assert sum(counts[HOT_LAYER][e] for e in HOT_EXPERTS) == sum(counts[HOT_LAYER])  # every token: 3 and 5
        assert sum(sorted(counts[0])[-2:]) / sum(counts[0]) <= COLLAPSE_SHARE
    warnings = [r for r in recs if r["kind"] == "warning"]
    assert len(warnings) == 1, warnings  # once per streak, not on steps 6, 7, 8
    w = warnings[0]
    assert (w["step"], w["layer"], w["experts"], w["share"]) == (COLLAPSE_STEPS, HOT_LAYER, HOT_EXPERTS, 1.0)
    lines = [ln for ln in open(tmp_path / "train.log").read().splitlines() if ln.startswith("warning:")]
    assert lines == ["warning: " + w["message"]]
    assert lines[0].startswith(
        f"warning: router collapse in layer {HOT_LAYER}: its 2 busiest experts (experts 3, 5) took more than 90%"
    )
    assert f"steps 1-{COLLAPSE_STEPS}" in lines[0]


def test_silent_on_the_readme_demo(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "pretrain_mixtral.py"), "logging.wandb.mode=disabled"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (metrics,) = glob.glob(str(tmp_path / "outputs" / "*" / "*" / "metrics.jsonl"))
    recs = [json.loads(line) for line in open(metrics)]
    train = [r for r in recs if r["kind"] == "train"]
    assert len(train) == 60 and not [r for r in recs if r["kind"] == "warning"]
    assert "warning: router collapse" not in run.stdout + run.stderr
    watch = CollapseWatch(moe_layers=list(range(len(train[0]["expert_counts"]))), topk=2)
    assert [w for r in train for w in watch.update(r["step"], r["expert_counts"])] == []
    busiest = max(sum(sorted(c)[-2:]) / sum(c) for r in train for c in r["expert_counts"])
    assert busiest < COLLAPSE_SHARE  # the demo's busiest pair never came near the threshold
