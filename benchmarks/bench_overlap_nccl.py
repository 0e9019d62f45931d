"""What NCCL's per-communicator order costs overlap, and what the metadata communicator gives back.

Runs :func:`benchmarks.bench_overlap.run_layout` (overlap off and on alternating step by step, under the
link model at ``--latency-ms``) in four settings, for every layout of ``--layouts``:

- ``no rule``: the link model without NCCL's order (``nccl_order=False``, as gloo behaves), each
  exchange complete its latency after this rank issued it (``peer_issue=False``);
- ``rule, counts on EP``: with the order, the dispatcher's count all-gathers on the EP communicator
  behind the token all-to-alls issued before them there (``meta_comm=False``);
- ``rule, ep_meta, own issue``: with the order, the counts on their own communicator
  (``ProcessGroups.ep_meta``), each exchange complete its latency after this rank issued it;
- ``rule, ep_meta``: the same, each exchange complete its latency after the *last* of its ranks issued
  it (``peer_issue``, as a network delivers a late peer's bytes): the engine's default and the link
  model's.

The host is shared and its speed changes from minute to minute, so the settings run interleaved, in a
rotated order, ``--repeats`` times, all in one pool of 4 gloo ranks; each run's own ratios (step on/off,
hidden) are what is compared, and the host's load average before and after every run is kept. The JSON
(``--json``) carries ``"nccl_order": true`` and ``"peer_issue": true`` at its top level (the engine's
default: the last setting), every run with its settings, load and exposed time by exchange, and per
setting × layout the medians and ranges over the repeats; ``--out`` writes the Markdown report.

Usage::

    python -m benchmarks.bench_overlap_nccl --layouts ep4,pp2ep2 --latency-ms 10 --repeats 3 \\
        --json benchmarks/results/overlap_nccl_order_cpu.json --out benchmarks/results/overlap_nccl_order_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from typing import Dict, List

import torch

from benchmarks import bench_overlap as bo
from folding.testing import RankPool

SETTINGS = (
    ("no rule", dict(nccl_order=False, peer_issue=False, meta_comm=True)),
    ("rule, counts on EP", dict(nccl_order=True, peer_issue=True, meta_comm=False)),
    ("rule, ep_meta, own issue", dict(nccl_order=True, peer_issue=False, meta_comm=True)),
    ("rule, ep_meta", dict(nccl_order=True, peer_issue=True, meta_comm=True)),
)
"""``(name, link-model settings)`` compared; the last is the engine's default."""

TARGET_HIDDEN, TARGET_RATIO = 0.70, 0.75
"""The targets: hidden >= 0.70 and step on / off <= 0.75."""


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="ep4,pp2ep2", help="comma-separated layouts of bench_overlap")
    p.add_argument("--latency-ms", type=float, default=10.0, help="link model: each EP exchange's latency")
    p.add_argument("--repeats", type=int, default=3, help="runs of every setting × layout, interleaved")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per mode and run (alternating off/on)")
    p.add_argument("--warmup", type=int, default=2, help="steps per mode not counted")
    p.add_argument("--json", default=None, help="write every run and the summary here")
    p.add_argument("--out", default=None, help="Markdown report")
    ns = p.parse_args(argv)
    for name in ns.layouts.split(","):
        if name not in bo.LAYOUTS:
            p.error(f"--layouts: unknown layout {name!r}; choose from {sorted(bo.LAYOUTS)}")
    if ns.repeats < 1:
        p.error("--repeats must be >= 1")
    return ns


def _base(ns) -> dict:
    """bench_overlap's settings for one run (its defaults, with this command's steps and latency)."""
    a = bo._settings(bo._args(["--steps", str(ns.steps), "--warmup", str(ns.warmup)]), ns.latency_ms)
    return a


def schedule(layouts: List[str], repeats: int) -> List[tuple]:
    """``(repeat, layout, setting name)`` in run order: per repeat and layout every setting once, the
    settings' order rotated by one each repeat (no setting always first after a layout change)."""
    out = []
    names = [n for n, _ in SETTINGS]
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for layout in layouts:
            out += [(r, layout, n) for n in order]
    return out


def summarize(runs: List[dict]) -> List[dict]:
    """Per setting × layout: the medians and ranges over the repeats of hidden and step on / off, and
    whether the medians meet the targets."""
    rows = []
    for name, _ in SETTINGS:
        for layout in dict.fromkeys(r["layout"] for r in runs):
            mine = [r for r in runs if r["setting"] == name and r["layout"] == layout]
            if not mine:
                continue
            hid = [r["hidden"] for r in mine if r["hidden"] is not None]
            rat = [r["step_time_ratio"] for r in mine]
            row = dict(setting=name, layout=layout, repeats=len(mine))
            row.update(hidden_median=statistics.median(hid) if hid else None)
            row["hidden_range"] = [min(hid), max(hid)] if hid else None
            row.update(ratio_median=statistics.median(rat), ratio_range=[min(rat), max(rat)])
            row["meets_targets"] = (
                bool(hid) and row["hidden_median"] >= TARGET_HIDDEN and row["ratio_median"] <= (TARGET_RATIO)
            )
            rows.append(row)
    return rows


def report(summary: List[dict], runs: List[dict], ns, command: str) -> str:
    """The Markdown report: the summary, every run with its load, and the exposed time by exchange."""
    lines = [
        "# Overlap under NCCL's per-communicator order (CPU link model)",
        "",
        f"Measured {datetime.date.today().isoformat()} on {platform.machine()}, {os.cpu_count()} CPUs (shared), "
        f"torch {torch.__version__}, 4 gloo ranks; link latency {ns.latency_ms:g} ms; every run "
        f"{ns.steps} steps per mode (overlap off and on alternating), medians of the last {ns.steps - ns.warmup}.",
        "",
        f"Command: `{command}`",
        "",
        f"Target: hidden >= {TARGET_HIDDEN:.2f} and step on / off <= {TARGET_RATIO:.2f}. Medians over "
        f"{ns.repeats} interleaved repeats (range in brackets):",
        "",
        "| setting | layout | hidden | step on / off | targets met |",
        "|---|---|---|---|---|",
    ]
    for s in summary:
        h = "n/a"
        if s["hidden_median"] is not None:
            h = f"{s['hidden_median']:.2f} [{s['hidden_range'][0]:.2f}, {s['hidden_range'][1]:.2f}]"
        lines.append(
            f"| {s['setting']} | {s['layout']} | {h} "
            f"| {s['ratio_median']:.2f} [{s['ratio_range'][0]:.2f}, {s['ratio_range'][1]:.2f}] "
            f"| {'yes' if s['meets_targets'] else 'no'} |"
        )
    lines += [
        "",
        "Every run, in run order (load average 1, 5, 15 min before and after the run):",
        "",
        "| # | setting | layout | step off (s) | step on (s) | on / off | exposed off (s) | exposed on (s) "
        "| hidden | load before | load after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(runs):
        h = "n/a" if r["hidden"] is None else f"{r['hidden']:.2f}"
        lines.append(
            f"| {i + 1} | {r['setting']} | {r['layout']} | {r['step_time_off_s']:.3f} | {r['step_time_on_s']:.3f} "
            f"| {r['step_time_ratio']:.2f} | {r['exposed_off_s']:.3f} | {r['exposed_on_s']:.3f} | {h} "
            f"| {r['load_before']} | {r['load_after']} |"
        )
    lines += ["", "Exposed seconds per step by what was waited on (medians over the repeats; off → on):", ""]
    whats = sorted({w for r in runs for w in (*r["exposed_by_off_s"], *r["exposed_by_on_s"])})
    lines += ["| setting | layout | " + " | ".join(whats) + " |", "|---|---|" + "---|" * len(whats)]
    for s in summary:
        mine = [r for r in runs if r["setting"] == s["setting"] and r["layout"] == s["layout"]]
        cells = []
        for w in whats:
            off = statistics.median(r["exposed_by_off_s"].get(w, 0.0) for r in mine)
            on = statistics.median(r["exposed_by_on_s"].get(w, 0.0) for r in mine)
            cells.append(f"{off:.3f} → {on:.3f}")
        lines.append(f"| {s['setting']} | {s['layout']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    """Command-line entry point (see the module docstring)."""
    ns = _args(argv)
    command = "python -m benchmarks.bench_overlap_nccl " + " ".join(sys.argv[1:] if argv is None else argv)
    settings: Dict[str, dict] = dict(SETTINGS)
    runs = []
    pool = RankPool(4)
    try:
        for rep, layout, name in schedule(ns.layouts.split(","), ns.repeats):
            a = dict(_base(ns), **settings[name])
            r = bo.run_layout(layout, a, pool)
            r.update(setting=name, repeat=rep)
            runs.append(r)
            h = "n/a" if r["hidden"] is None else f"{r['hidden']:.3f}"
            print(
                f"[{rep}] {name:26s} {layout:8s} on/off {r['step_time_ratio']:.3f} hidden {h} "
                f"(step off {r['step_time_off_s']:.3f} s; load {r['load_before']} -> {r['load_after']})",
                flush=True,
            )
    finally:
        pool.shutdown()
    summary = summarize(runs)
    if ns.json:
        out = dict(nccl_order=True, peer_issue=True, meta_comm=True, latency_ms=ns.latency_ms, command=command)
        out.update(link_rules=_base(ns)["link_rules"])  # bench_overlap's default link model
        out.update(settings=[dict(name=n, **s) for n, s in SETTINGS], summary=summary, runs=runs)
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=1)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(report(summary, runs, ns, command))
    for s in summary:
        h = "n/a" if s["hidden_median"] is None else f"{s['hidden_median']:.2f}"
        print(f"{s['setting']:26s} {s['layout']:8s} hidden {h} on/off {s['ratio_median']:.2f}")


if __name__ == "__main__":
    main()
