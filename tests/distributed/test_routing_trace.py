"""Routing traces recorded by training runs (``moe.trace_dir``) against the run's own metrics: the
README's main configuration on 1 rank (with a resume that appends), EP2 on 2 ranks with dropping,
where every source rank's counts and drops add up to its own tokens and the sums to the totals, and
PP2, where each layer comes from the ranks of its stage and the file still has every layer."""

import json
import os

import numpy as np

from folding.training.telemetry.trace_file import read_trace
from tools.plot_run import read_records
from tools.routing_trace import main as trace_main
from tools.routing_trace import summarize

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _readme_job(overrides):
    from folding.job.config import job_config_from_dict
    from folding.job.schema import register_schema
    from folding.launch import cli

    register_schema()
    tree = cli.compose_tree(overrides, config_dir=os.path.join(ROOT, "configs"), config_name="config")
    return job_config_from_dict(tree)


def _train(run_dir, overrides):
    from folding.training import trainer

    job = _readme_job(
        [
            f"moe.trace_dir={os.path.join(run_dir, 'trace')}",
            "logging.console=false",
            "logging.wandb.mode=disabled",
            "train.eval_interval=100",
            *overrides,
        ]
    )
    trainer.train(job, run_dir=run_dir)


def _train_records(run_dir):
    return [r for r in read_records(os.path.join(run_dir, "metrics.jsonl")) if r["kind"] == "train"]


def test_readme_config_trace_equals_metrics_and_resume_appends(ranks, tmp_path, capsys):
    run_dir = str(tmp_path)
    ck = [f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.save_interval=2"]
    ranks(1).run(_train, run_dir, ["train.steps=2", *ck])
    assert read_trace(tmp_path / "trace").header["last_step"] == 2
    ranks(1).run(_train, run_dir, ["train.steps=3", *ck])  # resumes from step 2 and appends step 3
    trace = read_trace(tmp_path / "trace")
    assert trace.steps.tolist() == [1, 2, 3]
    assert (trace.header["first_step"], trace.header["last_step"]) == (1, 3)
    assert trace.header["source_ranks"] == 1 and trace.header["model"] == "mixtral_tiny"
    recs = _train_records(run_dir)
    assert [r["step"] for r in recs] == [1, 2, 3]
    metrics_LE = np.array([r["expert_counts"] for r in recs]).sum(0)
    summary = summarize(trace)
    assert [lay["expert_totals"] for lay in summary["layers"]] == metrics_LE.astype(np.int64).tolist()
    assert metrics_LE.sum() > 0
    # a window through the command line's JSON
    assert trace_main([str(tmp_path / "trace"), "--steps", "2:3", "--json"]) == 0
    window = json.loads(capsys.readouterr().out)
    assert window["steps"] == [2, 3]
    want = np.array([r["expert_counts"] for r in recs[1:]]).sum(0).astype(np.int64).tolist()
    assert [lay["expert_totals"] for lay in window["layers"]] == want
    for s, r in enumerate(recs):  # the drops agree with the metrics' dropped fraction
        kept, drop = trace.counts_SLRE[s].sum(), trace.dropped_SLRE[s].sum()
        assert abs(drop / (kept + drop) - r["dropped_fraction"]) < 1e-9


def test_ep2_per_source_rank_counts_sum_to_totals(ranks, tmp_path):
    run_dir = str(tmp_path)
    over = ["parallel.ep=2", "parallel.etp=1", "moe.capacity_factor=1.0", "train.steps=2"]
    ranks(2).run(_train, run_dir, over)
    trace = read_trace(tmp_path / "trace")
    h = trace.header
    assert h["source_ranks"] == 2 and h["ep"] == 2 and h["layout"]["dp"] == 2
    recs = _train_records(run_dir)
    counts = trace.counts_SLRE.astype(np.int64)
    dropped = trace.dropped_SLRE.astype(np.int64)
    # the sum over the source ranks is the metrics' expert_counts, step by step
    assert counts.sum(2).tolist() == np.array([r["expert_counts"] for r in recs]).astype(np.int64).tolist()
    # each source rank routes its own tokens (global batch / DP2 sequences), top-k, kept or dropped
    t = _readme_job(over).train
    assert ((counts + dropped).sum(-1) == t.global_batch_size // 2 * t.seq_length * h["topk"]).all()
    assert (counts.sum(-1) > 0).all() and dropped.sum() > 0  # both ranks route; capacity 1.0 drops some
    for s, r in enumerate(recs):  # the drops agree with the metrics' dropped fraction
        kept, drop = counts[s].sum(), dropped[s].sum()
        assert abs(drop / (kept + drop) - r["dropped_fraction"]) < 1e-9


def test_pp2_trace_has_every_layer_from_its_stage(ranks, tmp_path):
    run_dir = str(tmp_path)
    ranks(2).run(_train, run_dir, ["parallel.pp=2", "train.steps=1"])
    trace = read_trace(tmp_path / "trace")
    counts = trace.counts_SLRE[0].astype(np.int64)  # [L, R, E]
    L = trace.header["num_layers"]
    assert L >= 2 and trace.header["layout"]["pp"] == 2
    per_rank_LR = counts.sum(-1)
    # the first half of the layers on stage 0 (rank 0), the rest on stage 1 (rank 1)
    assert (per_rank_LR[: L // 2, 0] > 0).all() and (per_rank_LR[L // 2 :, 0] == 0).all()
    assert (per_rank_LR[: L // 2, 1] == 0).all() and (per_rank_LR[L // 2 :, 1] > 0).all()
    assert counts.sum(1).tolist() == np.array(_train_records(run_dir)[0]["expert_counts"]).astype(np.int64).tolist()
