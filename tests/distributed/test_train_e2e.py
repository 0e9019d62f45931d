"""End-to-end tiny training runs inside the gloo rank pool: a folded layout trains like 1 rank, the
metrics file has one train record per step, and a NaN loss skips the update but not the schedule."""

import json
import math
import os

from folding.data.config import DataConfig
from folding.job.config import JobConfig, LoggingConfig, ParallelConfig, TrainConfig, WandbConfig
from folding.model.presets import get_preset
from folding.optim.config import OptimConfig

STEPS = 3


def tiny_job(parallel, metrics_file, **train):
    model = get_preset("mixtral_tiny", hidden_size=32, num_layers=2, moe={"ffn_hidden_size": 32})
    return JobConfig(
        model=model,
        parallel=ParallelConfig(**parallel),
        train=TrainConfig(
            **{
                **dict(
                    steps=STEPS,
                    global_batch_size=8,
                    micro_batch_size=2,
                    seq_length=16,
                    eval_interval=STEPS,
                    eval_steps=1,
                ),
                **train,
            }
        ),
        optim=OptimConfig(lr=1e-3, warmup_steps=0, decay_style="constant", clip_grad=1.0),
        data=DataConfig(),
        logging=LoggingConfig(metrics_file=metrics_file, console=False, wandb=WandbConfig(mode="disabled")),
    )


def _train_layouts(run_dir, layouts, nan_step):
    from folding.training import trainer

    out = []
    for i, parallel in enumerate(layouts):
        job = tiny_job(parallel, os.path.join(run_dir, f"m{i}.jsonl"))
        out.append(trainer.train(job, run_dir=run_dir)["history"])
    # A NaN in the loss at one step: the update is skipped, the LR schedule still advances.
    job = tiny_job(layouts[0], os.path.join(run_dir, "nan.jsonl"))
    real = trainer.run_microbatches

    def poisoned(chunks, mbs, **kw):
        res = real(chunks, mbs, **kw)
        if poisoned.calls == nan_step - 1 and not kw.get("forward_only"):
            res["lm_loss_sum"] = res["lm_loss_sum"] * float("nan")
        poisoned.calls += 0 if kw.get("forward_only") else 1
        return res

    poisoned.calls = 0
    trainer.run_microbatches = poisoned
    try:
        out.append(trainer.train(job, run_dir=run_dir)["history"])
    finally:
        trainer.run_microbatches = real
    return out


def test_folded_layout_trains_like_one_rank(ranks, tmp_path):
    single = ranks(1).run(_train_layouts, str(tmp_path / "one"), [dict()], 2)[0]
    multi = ranks(4).run(_train_layouts, str(tmp_path / "four"), [dict(tp=2, ep=4, etp=1), dict(ep=2, etp=1)], 2)
    ref = single[0]
    for r in range(4):
        for hist in multi[r][:2]:
            for a, b in zip(ref, hist):
                assert a["step"] == b["step"]
                assert math.isclose(a["lm_loss"], b["lm_loss"], rel_tol=1e-5), (a, b)
                assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (a, b)
    assert ref[-1]["lm_loss"] < ref[0]["lm_loss"]
    # metrics: exactly one train record per step, an eval record, written by rank 0 only
    recs = [json.loads(line) for line in open(tmp_path / "four" / "m0.jsonl")]
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert any(r["kind"] == "eval" for r in recs)
    for key in (
        "loss",
        "lm_loss",
        "grad_norm",
        "lr",
        "tokens_per_s",
        "tflops_per_device",
        "mfu",
        "mem_gib",
        "load_min",
        "load_max",
        "load_imbalance",
        "dropped_fraction",
    ):
        assert key in train[0], key
    assert len(train[0]["load_imbalance"]) == 2 and train[0]["dropped_fraction"] == 0.0
    # NaN at step 2: skipped, parameters unchanged, the LR schedule advanced
    nan_hist = single[1]
    assert [h["skipped"] for h in nan_hist] == [False, True, False]
    assert nan_hist[0]["lm_loss"] == ref[0]["lm_loss"]
    nan4 = multi[0][2]
    assert [h["skipped"] for h in nan4] == [False, True, False]
