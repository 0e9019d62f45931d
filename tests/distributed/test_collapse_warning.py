"""The router-collapse warning fires through the trainer: a router forced to send every token to one
expert is named (its layer, the expert) once its streak reaches 5 steps, once per streak, in the
console/log line and as a ``warning`` record of the metrics file; the other layer is not named.

The collapse is forced through the router's own selection-only expert bias (``moe.expert_bias=true``):
a forward pre-hook sets layer 1's bias to +100 on expert 3 before every forward, so every token's
top-2 includes expert 3 (its share of the layer's tokens is 100%) while the gate weights, the
probabilities and the rest of the model train as usual. Layer 0's bias moves by the normal update
rule (1e-3 per step) and its router stays balanced; the test checks that from the metrics too.
"""

import json
import os

import torch

from folding.data.config import DataConfig
from folding.model.presets import get_preset
from folding.moe.router import Router
from folding.optim.config import OptimConfig
from folding.training.collapse import COLLAPSE_SHARE, COLLAPSE_STEPS
from folding.training.config import JobConfig, LoggingConfig, TrainConfig, WandbConfig

STEPS = 8
HOT_LAYER, HOT_EXPERT = 1, 3


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
    """Forward pre-hook: the router's expert bias favours HOT_EXPERT by far (returns None: the inputs stay)."""
    with torch.no_grad():
        router.expert_bias.zero_()
        router.expert_bias[HOT_EXPERT] = 100.0


def _train_collapsed(run_dir):
    from folding.training import trainer
    from folding.training.run_dir import RunLog

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
        assert counts[HOT_LAYER][HOT_EXPERT] * 2 == sum(counts[HOT_LAYER])  # every token chose expert 3
        assert max(counts[0]) * 2 / sum(counts[0]) <= COLLAPSE_SHARE
    warnings = [r for r in recs if r["kind"] == "warning"]
    assert len(warnings) == 1, warnings  # once per streak, not on steps 6, 7, 8
    w = warnings[0]
    assert (w["step"], w["layer"], w["experts"], w["share"]) == (COLLAPSE_STEPS, HOT_LAYER, [HOT_EXPERT], 1.0)
    lines = [ln for ln in open(tmp_path / "train.log").read().splitlines() if ln.startswith("warning:")]
    assert lines == ["warning: " + w["message"]]
    assert lines[0].startswith(f"warning: router collapse in layer {HOT_LAYER}: expert {HOT_EXPERT} got more than 90%")
    assert f"steps 1-{COLLAPSE_STEPS}" in lines[0]
