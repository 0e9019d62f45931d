"""Optimizer state on the default tiny model: fp32 AdamW against bf16 / fp8 moments, bf16 master weights and Muon.

Trains the job of the README's main command (``configs/config.yaml``: mixtral_tiny on the embedded
corpus) on one process for ``--steps`` steps, once per variant, every run from the same seed (same
initial weights, same batches), and reports per variant the final training loss, the largest gap
to the fp32 run's loss over the run (absolute and relative), and the optimizer-state bytes per
parameter, measured from the optimizer's buffers (``FoldedOptimizer.memory_bytes``: moments, fp8
scales, master copies) and predicted (:class:`folding.planning.optim_precision.OptimizerPrecision`).

Variants (``optim.*`` overrides):

- ``fp32``: fp32 parameters, fp32 moments (the default);
- ``bf16 moments``: ``exp_avg_dtype=bf16 exp_avg_sq_dtype=bf16``;
- ``fp8 moments``: ``exp_avg_dtype=fp8 exp_avg_sq_dtype=fp8``;
- ``bf16 params, fp32 master``: ``train.precision=bf16`` (the reference of the next one);
- ``bf16 params, bf16 master``: ``train.precision=bf16 optim.main_params_dtype=bf16`` (stochastic rounding);
- ``muon``: ``optim.name=muon`` (Muon for the hidden matrices, fp32 AdamW for the rest; same LR schedule).

``--reuse JSON`` starts from the curves of an earlier run (the JSON this benchmark writes) and runs only
the ``--only`` variants; the first loss of a rerun must equal the stored fp32 run's first loss (same
weights, same batch, before any update), or the benchmark refuses to mix the two.

Writes a markdown report and a PNG of the loss curves (matplotlib) and notes the host's load.

Usage::

    python -m benchmarks.bench_optimizer_precision --steps 100 --global-batch-size 4 \\
        --out benchmarks/results/optimizer_precision_cpu.md
    python -m benchmarks.bench_optimizer_precision --steps 100 --global-batch-size 4 --only muon \\
        --reuse benchmarks/results/optimizer_precision_cpu.json --out benchmarks/results/optimizer_precision_cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from folding.job.config import job_config_from_dict
from folding.job.schema import register_schema
from folding.launch.cli import compose_tree
from folding.parallel.groups import release_process_groups
from folding.planning.memory import state_bytes_per_param
from folding.planning.optim_precision import OptimizerPrecision
from folding.training import trainer

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
VARIANTS = [
    ("fp32", []),
    ("bf16 moments", ["optim.exp_avg_dtype=bf16", "optim.exp_avg_sq_dtype=bf16"]),
    ("fp8 moments", ["optim.exp_avg_dtype=fp8", "optim.exp_avg_sq_dtype=fp8"]),
    ("bf16 params, fp32 master", ["train.precision=bf16"]),
    ("bf16 params, bf16 master", ["train.precision=bf16", "optim.main_params_dtype=bf16"]),
    ("muon", ["optim.name=muon"]),
]


def run_variant(overrides, steps: int, run_dir: str, batch: int) -> dict:
    """Train one variant on the initialized 1-rank world; its losses, seconds and state bytes."""
    args = [
        f"train.steps={steps}",
        f"train.global_batch_size={batch}",
        "train.eval_interval=0",
        "train.threads=1",
        "logging.console=false",
        "logging.wandb.mode=disabled",
        *overrides,
    ]
    job = job_config_from_dict(compose_tree(args, config_dir=CONFIGS, config_name="config"))
    t0 = time.perf_counter()
    res = trainer.train(job, run_dir=run_dir)
    secs = time.perf_counter() - t0
    mem = res["optimizer"].memory_bytes()
    n = sum(p.numel() for c in res["chunks"] for p in c.parameters())
    width = 2 if job.train.precision == "bf16" else 4
    return {
        "losses": [h["lm_loss"] for h in res["history"]],
        "skipped": sum(bool(h["skipped"]) for h in res["history"]),
        "stopped": bool(res["stopped"]),
        "seconds": secs,
        "state_bytes_per_param": (mem["optimizer_dense"] + mem["optimizer_expert"]) / n,
        "predicted_bytes_per_param": state_bytes_per_param(
            job.model, OptimizerPrecision.of(job.optim), param_bytes=width
        ),
        "params": n,
    }


def report(results: dict, *, steps: int, batch: int, command: str, load: tuple, png: str) -> str:
    """The markdown report (gaps are to the fp32 run, step by step)."""
    ref = results["fp32"]["losses"] if "fp32" in results else next(iter(results.values()))["losses"]
    lines = [
        "# Optimizer state on the default tiny model: AdamW precisions and Muon (CPU)",
        "",
        f"Command: `{command}`",
        "",
        f"The job of `configs/config.yaml` (mixtral_tiny, 0.71 M parameters, embedded corpus, seq 64, "
        f"micro-batch 2; global batch {batch}), one process, one thread, {steps} steps per variant "
        f"(cosine schedule over them), seed 1234 for all: same initial weights and batches. "
        f"Host load average (1 min) at the start / after the last variant: {load[0]} / {load[1]} (a shared "
        f"2-core machine; times are "
        f"wall-clock and only indicative). Optimizer-state bytes per parameter are measured from the "
        f"optimizer's buffers (moments, fp8 block scales, master copies; the routers' fp32 gating weights "
        f"never get a master copy, hence slightly under the predicted value for bf16 parameters; Muon: one "
        f"fp32 momentum for the hidden matrices, fp32 AdamW moments for embedding, output layer, norms and "
        f"router).",
        "",
        "| variant | steps run (skipped) | final loss | vs fp32 at that step | mean of the last 10 steps "
        "(fp32's) | max abs gap to fp32 | max rel gap | state bytes/param (measured / predicted) | time (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        gaps = [abs(a - b) for a, b in zip(r["losses"], ref)]
        rel = [g / abs(b) for g, b in zip(gaps, ref)]
        k = max(range(len(gaps)), key=gaps.__getitem__)
        final, n = r["losses"][-1], len(r["losses"])
        tail, ref_tail = sum(r["losses"][-10:]) / len(r["losses"][-10:]), sum(ref[max(0, n - 10) : n]) / min(n, 10)
        lines.append(
            f"| {name} | {n} ({r['skipped']}){' stopped' if r['stopped'] else ''} | {final:.4f} | "
            f"{100 * (final - ref[n - 1]) / ref[n - 1]:+.2f}% | {tail:.4f} ({ref_tail:.4f}) | "
            f"{gaps[k]:.4f} (step {k + 1}) | "
            f"{100 * max(rel):.2f}% | {r['state_bytes_per_param']:.2f} / {r['predicted_bytes_per_param']:.2f} | "
            f"{r['seconds']:.0f} |"
        )
    lines += [
        "",
        f"![loss curves]({os.path.basename(png)})",
        "",
        "Loss is the training lm loss of each step (its own batch), so step-to-step noise is the batches'; "
        "the gap columns compare the same step of two runs, which see the same batch. A run marked "
        "`stopped` received a stop request (SIGTERM: the benchmark's time limit) and ended cleanly early; "
        "it is compared with fp32 at its own last steps.",
    ]
    return "\n".join(lines) + "\n"


def plot(results: dict, png: str) -> None:
    """Loss curves and the gap to fp32, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = results["fp32"]["losses"] if "fp32" in results else next(iter(results.values()))["losses"]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name, r in results.items():
        steps = range(1, len(r["losses"]) + 1)
        a.plot(steps, r["losses"], label=name, lw=1)
        b.plot(steps, [x - y for x, y in zip(r["losses"], ref)], label=name, lw=1)
    a.set_ylabel("training loss")
    a.legend()
    b.set_ylabel("loss - fp32 loss")
    b.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def _slug(name: str) -> str:
    """A variant's name usable in ``--only``: ``bf16 params, fp32 master`` -> ``bf16_params_fp32_master``."""
    return name.replace(",", "").replace(" ", "_")


def _merge(a, argv) -> int:
    """``--from-json``: one report and plot from the curves of runs made in separate processes."""
    results = {}
    for path in a.from_json.split(","):
        with open(path, encoding="utf-8") as f:
            results.update(json.load(f))
    firsts = {k: v["losses"][0] for k, v in results.items() if not k.startswith("bf16 params")}
    if len(set(firsts.values())) > 1:
        raise SystemExit(f"runs of different setups (first losses {firsts}): not one benchmark")
    png = os.path.splitext(a.out)[0] + ".png"
    command = "python -m benchmarks.bench_optimizer_precision " + " ".join(argv if argv is not None else sys.argv[1:])
    load = tuple((a.load or "?,?").split(","))
    with open(a.out, "w", encoding="utf-8") as f:
        f.write(report(results, steps=a.steps, batch=a.global_batch_size, command=command, load=load, png=png))
    with open(os.path.splitext(a.out)[0] + ".json", "w", encoding="utf-8") as f:
        json.dump(results, f)
    plot(results, png)
    return 0


def main(argv=None) -> int:
    """Run every variant and write the report, its PNG and a JSON of the curves."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="steps per variant (default 300)")
    p.add_argument("--global-batch-size", type=int, default=16, help="samples per step (default 16, the config's)")
    p.add_argument("--out", default="benchmarks/results/optimizer_precision_cpu.md", help="markdown report path")
    p.add_argument(
        "--only",
        default=None,
        help="comma-separated variant names or slugs (names with '_' for spaces and no commas, e.g. "
        "bf16_params_fp32_master; default: all)",
    )
    p.add_argument("--reuse", default=None, help="JSON of an earlier run: keep its variants, run only --only's")
    p.add_argument(
        "--from-json",
        default=None,
        help="comma-separated JSONs of runs made in parallel (same --steps and batch): write their joint report "
        "and plot without training; their first losses must agree",
    )
    p.add_argument("--load", default=None, help="with --from-json: the host load line's two numbers, e.g. 11.9,12.0")
    a = p.parse_args(argv)
    if a.from_json:
        return _merge(a, argv)
    register_schema()  # the presets as Hydra config groups (model=mixtral_tiny)
    load0 = os.getloadavg()
    tmp = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    png = os.path.splitext(a.out)[0] + ".png"
    command = "python -m benchmarks.bench_optimizer_precision " + " ".join(argv if argv is not None else sys.argv[1:])
    try:
        results = {}
        if a.reuse:
            with open(a.reuse, encoding="utf-8") as f:
                results = {k: v for k, v in json.load(f).items() if not a.only or k not in a.only.split(",")}
        for name, overrides in VARIANTS:
            if a.only and name not in a.only.split(",") and _slug(name) not in a.only.split(","):
                continue
            torch.manual_seed(0)
            results[name] = run_variant(
                overrides, a.steps, os.path.join(tmp, name.replace(" ", "_")), a.global_batch_size
            )
            res = results[name]
            ref = results.get("fp32")
            if a.reuse and ref and res["losses"][0] != ref["losses"][0]:
                with open(os.path.splitext(a.out)[0] + f".{name.replace(' ', '_')}.json", "w", encoding="utf-8") as f:
                    json.dump(res, f)  # kept, not mixed into the report
                raise SystemExit(f"{name}: first loss {res['losses'][0]} != the stored fp32 run's {ref['losses'][0]}")
            print(f"{name}: final loss {res['losses'][-1]:.4f} in {res['seconds']:.0f} s", flush=True)
            # written after every variant, so that a run cut short still leaves its finished columns
            load = tuple(f"{x:.1f}" for x in (load0[0], os.getloadavg()[0]))
            text = report(results, steps=a.steps, batch=a.global_batch_size, command=command, load=load, png=png)
            with open(a.out, "w", encoding="utf-8") as f:
                f.write(text)
            with open(os.path.splitext(a.out)[0] + ".json", "w", encoding="utf-8") as f:
                json.dump(results, f)
            plot(results, png)
    finally:
        release_process_groups()  # frees the groups' native threads before exit
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
