"""Plot a run's metrics JSONL: the loss curve (train and eval) and a layer x expert load heatmap.

    python -m tools.plot_run outputs/2026-01-01/12-00-00 --out run.png      # a run directory
    python -m tools.plot_run outputs/2026-01-01/12-00-00/metrics.jsonl --out run.png

A resumed run appends to the same file: the records written after each restart replace the earlier
ones of the steps it repeats (steps after the checkpoint it resumed from).

The heatmap shows each expert's share of its layer's routed tokens, averaged over the steps of the
run (or the last ``--last`` steps); 1/E everywhere is perfect balance.
"""

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


def read_records(path):
    """Every JSON record of ``path`` (a metrics file, or a run directory holding ``metrics.jsonl``;
    blank lines skipped), with the steps repeated by a resumed run taken from its latest attempt."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path, encoding="utf-8") as f:
        return latest_attempt([json.loads(line) for line in f if line.strip()])


def latest_attempt(records):
    """``records`` where each ``run`` record starting at step ``s`` drops the earlier ``train`` and
    ``eval`` records of steps ``>= s`` (they were redone after a resume)."""
    out = []
    for r in records:
        if r.get("kind") == "run" and r.get("start_step") is not None:
            s = r["start_step"]
            out = [o for o in out if o.get("kind") not in ("train", "eval") or o.get("step", 0) < s]
        out.append(r)
    return out


def load_matrix(train, last=None):
    """Mean share of routed tokens per (MoE layer, expert) over the ``train`` records (or the last N)."""
    rows = [r["expert_counts"] for r in train if r.get("expert_counts")]
    if last:
        rows = rows[-last:]
    if not rows:
        return None
    counts = np.asarray(rows, dtype=np.float64)  # [steps, L, E]
    share = counts / np.maximum(counts.sum(axis=2, keepdims=True), 1.0)
    return share.mean(axis=0)


def plot(records, out, last=None, title=None):
    """Draw the two panels into ``out`` (PNG)."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train:
        raise SystemExit("no 'train' records in the metrics file")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    steps = [r["step"] for r in train]
    ax1.plot(steps, [r["lm_loss"] for r in train], label="train lm_loss")
    ax1.plot(steps, [r["loss"] for r in train], label="train loss (with aux)", alpha=0.6)
    if evals:
        ax1.plot([r["step"] for r in evals], [r["lm_loss"] for r in evals], "o-", label="eval lm_loss")
    skipped = [r["step"] for r in train if r.get("skipped")]
    for s in skipped:
        ax1.axvline(s, color="red", alpha=0.3)
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss")
    ax1.set_title(title or "loss")
    ax1.grid(alpha=0.3)
    ax1.legend()
    mat = load_matrix(train, last)
    if mat is None:
        ax2.text(0.5, 0.5, "no expert counts", ha="center")
    else:
        im = ax2.imshow(mat, aspect="auto", cmap="viridis")
        ax2.set_xticks(range(mat.shape[1]))
        ax2.set_yticks(range(mat.shape[0]))
        ax2.set_xlabel("expert")
        ax2.set_ylabel("MoE layer")
        ax2.set_title(f"share of routed tokens (uniform = {1 / mat.shape[1]:.3f})")
        fig.colorbar(im, ax=ax2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main(argv=None):
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", help="a run directory, or its metrics JSONL file")
    p.add_argument("--out", default="run.png", help="output PNG (default run.png)")
    p.add_argument("--last", type=int, default=None, help="average the heatmap over the last N steps only")
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    print(plot(read_records(a.metrics), a.out, a.last, a.title))


if __name__ == "__main__":
    sys.exit(main())
