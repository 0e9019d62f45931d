"""Plot a run's metrics JSONL: the loss curve (train and eval), each MoE layer's load imbalance per
step, and a layer x expert load heatmap.

    python -m tools.plot_run outputs/2026-01-01/12-00-00 --out run.png      # a run directory
    python -m tools.plot_run outputs/2026-01-01/12-00-00/metrics.jsonl --out run.png
    python -m tools.plot_run outputs/2026-01-01/12-00-00 --steps 10:60      # heatmap of steps 10..60

A resumed run appends to the same file: the records written after each restart replace the earlier
ones of the steps it repeats (steps after the checkpoint it resumed from).

The middle panel has one line per MoE layer: max ÷ mean tokens per expert at every step (1 is
perfect balance, E/k means every token of the layer chose the same k experts); dashed vertical lines
mark the steps where hot-expert replicas were re-planned (``replan`` records, ``moe.expert_replicas``).
The heatmap shows each expert's share of its layer's routed tokens averaged over a window of steps (``--steps A:B``,
both ends included, either may be left out; or the last ``--last`` steps; default the whole run),
shaded on the imbalance panel; 1/E everywhere is perfect balance. Its colour scale starts at 0 (small
differences stay small) and its title gives the range. An average hides a router whose
hot expert changes from step to step: read the imbalance curves first.
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
    """``records`` where each ``run`` record starting at step ``s`` drops the earlier ``train``, ``eval``
    and ``replan`` records of steps ``>= s`` (they were redone after a resume)."""
    out = []
    for r in records:
        if r.get("kind") == "run" and r.get("start_step") is not None:
            s = r["start_step"]
            out = [o for o in out if o.get("kind") not in ("train", "eval", "replan") or o.get("step", 0) < s]
        out.append(r)
    return out


def parse_steps(text):
    """``"A:B"`` (``"A:"``, ``":B"``) -> ``(A, B)`` with ``None`` for an open end; both ends included."""
    parts = text.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        lo, hi = (int(x) if x.strip() else None for x in parts)
    except ValueError:
        raise SystemExit(f"--steps {text!r}: expected FIRST:LAST step numbers, e.g. --steps 10:60 or --steps 10:")
    if lo is not None and hi is not None and hi < lo:
        raise SystemExit(f"--steps {text!r}: the last step {hi} comes before the first {lo}")
    return lo, hi


def in_window(train, last=None, steps=None):
    """The ``train`` records of the heatmap's window: steps ``steps=(first, last)`` (ends included,
    ``None`` open), or else the last ``last`` records, or else all."""
    if steps is not None:
        lo, hi = steps
        return [r for r in train if (lo is None or r["step"] >= lo) and (hi is None or r["step"] <= hi)]
    return train[-last:] if last else train


def load_matrix(train, last=None, steps=None):
    """Mean share of routed tokens per (MoE layer, expert) over the ``train`` records of the window
    (:func:`in_window`); ``None`` when the window holds no expert counts."""
    rows = [r["expert_counts"] for r in in_window(train, last, steps) if r.get("expert_counts")]
    if not rows:
        return None
    counts = np.asarray(rows, dtype=np.float64)  # [steps, L, E]
    share = counts / np.maximum(counts.sum(axis=2, keepdims=True), 1.0)
    return share.mean(axis=0)


def replan_steps(records):
    """The steps at which the hot-expert replica slots were re-planned (``replan`` records), ascending."""
    return sorted({r["step"] for r in records if r.get("kind") == "replan"})


def imbalance_curves(train):
    """``(steps, imb_SL)``: the steps with expert counts and, per step and MoE layer, max ÷ mean tokens
    per expert (from ``expert_counts``); ``None`` without counts."""
    rows = [(r["step"], r["expert_counts"]) for r in train if r.get("expert_counts")]
    if not rows:
        return None
    counts = np.asarray([c for _, c in rows], dtype=np.float64)  # [steps, L, E]
    mean = np.maximum(counts.mean(axis=2), 1e-12)
    return [s for s, _ in rows], counts.max(axis=2) / mean


def _draw_imbalance(ax, train, window, replans=()):
    curves = imbalance_curves(train)
    if curves is None:
        ax.text(0.5, 0.5, "no expert counts", ha="center")
        return
    steps, imb = curves
    for layer in range(imb.shape[1]):
        ax.plot(steps, imb[:, layer], label=f"MoE layer {layer}", lw=1.2)
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    for i, s in enumerate(replans):
        ax.axvline(s, color="purple", lw=0.8, ls="--", alpha=0.6, label="replica re-plan" if i == 0 else None)
    if window:
        ax.axvspan(window[0]["step"] - 0.5, window[-1]["step"] + 0.5, color="gray", alpha=0.12, label="heatmap steps")
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean tokens per expert")
    ax.set_title("load imbalance per layer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot(records, out, last=None, title=None, steps=None):
    """Draw the three panels into ``out`` (PNG); the heatmap averages the window of ``steps``
    (``(first, last)``) or of the ``last`` steps (:func:`in_window`)."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train:
        raise SystemExit("no 'train' records in the metrics file")
    window = in_window(train, last, steps)
    if not window:
        raise SystemExit(
            f"no 'train' records in the chosen steps (the run has steps {train[0]['step']}-{train[-1]['step']})"
        )
    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(17, 4.5))
    xs = [r["step"] for r in train]
    ax1.plot(xs, [r["lm_loss"] for r in train], label="train lm_loss")
    ax1.plot(xs, [r["loss"] for r in train], label="train loss (with aux)", alpha=0.6)
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
    _draw_imbalance(ax3, train, window, replan_steps(records))
    mat = load_matrix(train, last, steps)
    if mat is None:
        ax2.text(0.5, 0.5, "no expert counts", ha="center")
    else:
        im = ax2.imshow(mat, aspect="auto", cmap="viridis", vmin=0.0, vmax=max(float(mat.max()), 1e-12))
        ax2.set_xticks(range(mat.shape[1]))
        ax2.set_yticks(range(mat.shape[0]))
        ax2.set_xlabel("expert")
        ax2.set_ylabel("MoE layer")
        span = f"steps {window[0]['step']}-{window[-1]['step']}"
        ax2.set_title(
            f"share of routed tokens, mean of {span}\n(uniform {1 / mat.shape[1]:.3f}; "
            f"range {mat.min():.3f}-{mat.max():.3f}; scale from 0)",
            fontsize=10,
        )
        fig.colorbar(im, ax=ax2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main(argv=None):
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("metrics", help="a run directory, or its metrics JSONL file")
    p.add_argument("--out", default="run.png", help="output PNG (default run.png)")
    p.add_argument("--last", type=int, default=None, help="average the heatmap over the last N steps only")
    p.add_argument(
        "--steps", default=None, help="average the heatmap over steps FIRST:LAST (ends included; e.g. 10:60, 10:)"
    )
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    if a.steps is not None and a.last is not None:
        raise SystemExit("--steps and --last both choose the heatmap's steps: give one of them")
    steps = parse_steps(a.steps) if a.steps is not None else None
    print(plot(read_records(a.metrics), a.out, a.last, a.title, steps))


if __name__ == "__main__":
    sys.exit(main())
