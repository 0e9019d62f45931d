"""Step time while a checkpoint is saved, with ``checkpoint.async_save`` off and on.

The real trainer on ``--world`` gloo ranks (:class:`folding.testing.RankPool`) trains ``mixtral_tiny``
widened to ``--hidden`` / ``--ffn`` for ``--steps`` steps, saving every ``--interval`` steps (the last
step always saves and waits). Every loop iteration (one step with its checkpoint phase) is timed on
every rank by wrapping the trainer's step function; a step's time is that of its slowest rank. The
modes alternate, ``--repeats`` runs each, in the same ranks. Per mode the report gives the median
of the steps with no save near them, of the steps that start a save (they include what the save
blocks: the whole write when synchronous, the host copy when asynchronous), of the steps that follow
a save (while an asynchronous write runs behind them), the sum over one save period, and the loop's
blocked time from the run's ``checkpoint`` records. Nothing here asserts a timing.

Usage::

    python -m benchmarks.bench_checkpoint --world 2 --hidden 256 --ffn 512 --steps 12 --interval 4 \\
        --out benchmarks/results/checkpoint_async_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from folding.data.config import DataConfig
from folding.job.config import CheckpointConfig, JobConfig, LoggingConfig, ParallelConfig, TrainConfig, WandbConfig
from folding.model.presets import get_preset
from folding.optim.config import OptimConfig
from folding.testing import RankPool
from folding.training import trainer


def _job(a, ckpt_dir: str, async_save: bool) -> JobConfig:
    model = get_preset("mixtral_tiny", hidden_size=a.hidden, moe={"ffn_hidden_size": a.ffn})
    return JobConfig(
        model=model,
        parallel=ParallelConfig(ep=a.world, etp=1),
        train=TrainConfig(
            steps=a.steps, global_batch_size=a.batch, micro_batch_size=1, seq_length=a.seq, eval_interval=0
        ),
        optim=OptimConfig(decay_steps=a.steps),
        data=DataConfig(),
        checkpoint=CheckpointConfig(dir=ckpt_dir, save_interval=a.interval, async_save=async_save),
        logging=LoggingConfig(console=False, wandb=WandbConfig(mode="disabled")),
    )


def run_worker(a, root: str, async_save: bool):
    """On every rank: one training run; ``(step, seconds)`` of each loop iteration, the checkpoint
    records (rank 0) and the size of the last checkpoint in bytes (rank 0)."""
    torch.set_num_threads(1)
    ck, run_dir = os.path.join(root, "ck"), os.path.join(root, "run")
    real, times = trainer._train_step, []

    def timed(run, step):
        t0 = time.perf_counter()
        real(run, step)
        times.append((step, time.perf_counter() - t0))

    trainer._train_step = timed
    try:
        dist.barrier()
        trainer.train(_job(a, ck, async_save), run_dir=run_dir)
    finally:
        trainer._train_step = real
    records, size = [], 0
    if dist.get_rank() == 0:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            records = [r for r in map(json.loads, f) if r["kind"] == "checkpoint"]
        last = os.path.join(ck, sorted(os.listdir(ck))[-1])
        size = sum(os.path.getsize(os.path.join(d, n)) for d, _, files in os.walk(last) for n in files)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return times, records, size


def summarize(a, runs):
    """Per mode: medians of the step classes, the save period's sum and the blocked time."""
    saving = set(range(a.interval, a.steps, a.interval))  # not the last step: it waits in both modes
    after = {s + k for s in saving for k in range(1, a.interval) if s + k < a.steps}
    quiet = {s for s in range(2, a.interval)}  # step 1 warms up
    out = {}
    for mode, results in runs.items():
        # each run's slowest rank per step, then the median over runs
        per_run = [
            {s: max(dict(times)[s] for times, _, _ in per_rank) for s in range(1, a.steps + 1)} for per_rank in results
        ]
        med = {s: statistics.median(r[s] for r in per_run) for s in range(1, a.steps + 1)}
        blocked = [
            rec["blocked_s"]
            for per_rank in results
            for rec in per_rank[0][1]
            if rec["step"] in saving and "blocked_s" in rec
        ]
        period = [sum(r[s] for s in range(a.interval, 2 * a.interval)) for r in per_run]
        out[mode] = dict(
            quiet=statistics.median(med[s] for s in quiet),
            saving=statistics.median(med[s] for s in saving),
            after=statistics.median(med[s] for s in after),
            period=statistics.median(period),
            blocked=statistics.median(blocked) if blocked else float("nan"),
            steps=med,
            size=results[0][0][2],
        )
    return out


def report(a, argv, summary) -> str:
    """Markdown report."""
    load = os.getloadavg()
    rows = [
        "| `checkpoint.async_save` | step, no save near (s) | step that saves (s) | steps after a save (s) | "
        f"steps {a.interval}-{2 * a.interval - 1} together (s) | loop blocked per save (s) |",
        "|---|---|---|---|---|---|",
    ]
    for mode, s in summary.items():
        rows.append(
            f"| {mode} | {s['quiet']:.3f} | **{s['saving']:.3f}** | {s['after']:.3f} | {s['period']:.3f} | "
            f"{s['blocked']:.3f} |"
        )
    per_step = ["| step | " + " | ".join(summary) + " |", "|---|" + "---|" * len(summary)]
    for step in sorted(next(iter(summary.values()))["steps"]):
        per_step.append(f"| {step} | " + " | ".join(f"{s['steps'][step]:.3f}" for s in summary.values()) + " |")
    size = next(iter(summary.values()))["size"]
    off, on = summary["false"], summary["true"]
    verdict = (
        f"The step that saves took **{off['saving']:.2f} s** synchronously and **{on['saving']:.2f} s** "
        f"asynchronously (the loop blocked {off['blocked']:.2f} s vs {on['blocked']:.2f} s per save; a step "
        f"with no save near: {off['quiet']:.2f} / {on['quiet']:.2f} s). Over the save period, steps "
        f"{a.interval}-{2 * a.interval - 1}, the totals were {off['period']:.2f} s and {on['period']:.2f} s: "
        f"the background write runs on the same {os.cpu_count()} CPU cores as the ranks here, so the steps "
        "after an asynchronous save pay for part of what the saving step no longer waits for."
    )
    return "\n".join(
        [
            "# Step time during a checkpoint save: `checkpoint.async_save` off and on",
            "",
            f"- device: CPU ({platform.machine()}, {os.cpu_count()} cores visible), {a.world} gloo ranks "
            "(EP over all of them), 1 torch thread each, fp32",
            f"- torch {torch.__version__}, python {platform.python_version()}",
            f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            f"- host load average at the end (1/5/15 min): {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
            "(shared machine: timings are noisy; medians over alternating runs)",
            f"- command: `python -m benchmarks.bench_checkpoint {' '.join(argv)}`",
            f"- model: mixtral_tiny with H={a.hidden}, expert F={a.ffn}; global batch {a.batch} x seq {a.seq}; "
            f"{a.steps} steps, a save every {a.interval}; checkpoint size {size / 2**20:.0f} MiB "
            f"(weights + AdamW moments), written to `{a.tmp or tempfile.gettempdir()}`",
            "",
            "A step's time is one loop iteration of its slowest rank, including its checkpoint phase. "
            "Synchronous: the step that saves also writes the whole checkpoint. Asynchronous: it copies the "
            "state to host memory and hands it to DCP's save thread; the write then runs behind the next "
            "steps, which share the CPU cores with it here (on a GPU node the steps' compute would be on "
            "the GPU instead; not measured). Blocked time: the `blocked_s` of the run's `checkpoint` records.",
            "",
            *rows,
            "",
            verdict,
            "",
            "Median per step (the last step's save is waited for in both modes):",
            "",
            *per_step,
            "",
        ]
    )


def main(argv=None):
    """Parse arguments, run both modes alternately, print and write the report."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, d in (
        ("world", 2),
        ("hidden", 256),
        ("ffn", 512),
        ("seq", 64),
        ("batch", 8),
        ("steps", 12),
        ("interval", 4),
        ("repeats", 2),
    ):
        p.add_argument(f"--{name}", type=int, default=d)
    p.add_argument("--tmp", default=None, help="where checkpoints are written (default: the system temp dir)")
    p.add_argument("--out", default=None, help="markdown report path")
    a = p.parse_args(argv)
    if a.steps < 2 * a.interval + 1:
        p.error("--steps must be at least 2 * --interval + 1 (two saves before the last step)")
    runs = {"false": [], "true": []}
    with RankPool(a.world) as pool:
        for i in range(a.repeats):
            for mode in runs:
                root = tempfile.mkdtemp(prefix="bench_ckpt_", dir=a.tmp)
                runs[mode].append(pool.run(run_worker, a, root, mode == "true", timeout_s=1800))
                print(f"repeat {i} async_save={mode}: done", flush=True)
    text = report(a, argv, summarize(a, runs))
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
