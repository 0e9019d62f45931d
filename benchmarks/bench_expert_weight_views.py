"""Per-expert weight views vs one ``unbind``: the backward cost of handing packed expert weights to a
per-expert kernel (the loop and TransformerEngine backends).

``w_EOI[e]`` for each expert makes E ``select`` autograd nodes; in backward each one allocates a zero
tensor the size of the whole ``[E, O, K]`` weight and adds its slice: E weight-sized buffers per GEMM.
``w_EOI.unbind(0)`` is one node whose backward stacks the E gradients once. Both variants run the same
per-expert matmuls; timings alternate in one process, best and median of ``--reps``.

Usage::

    python -m benchmarks.bench_expert_weight_views [--experts 8,32] [--reps 15] \\
        [--out benchmarks/results/expert_weight_views_cpu.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch


def _step(w_EOI, x_NI, counts, views):
    ws = w_EOI.unbind(0) if views == "unbind" else [w_EOI[e] for e in range(w_EOI.shape[0])]
    y = torch.cat([x @ w.t() for x, w in zip(x_NI.split(counts), ws)])
    y.sum().backward()


def measure(E, reps, O=256, K=256, rows=16):
    w = torch.randn(E, O, K, requires_grad=True)
    x = torch.randn(E * rows, K)
    counts = [rows] * E
    times = {"select": [], "unbind": []}
    for _ in range(reps):
        for views in times:
            w.grad = None
            t = time.perf_counter()
            _step(w, x, counts, views)
            times[views].append(time.perf_counter() - t)
    return {k: (min(v), statistics.median(v)) for k, v in times.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", default="8,32")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.manual_seed(0)
    load0 = os.getloadavg()[0]
    lines = [
        "| experts | select min / median (ms) | unbind min / median (ms) | select / unbind (median) |",
        "|---|---|---|---|",
    ]
    for E in [int(e) for e in a.experts.split(",")]:
        r = measure(E, a.reps)
        (smin, smed), (umin, umed) = r["select"], r["unbind"]
        lines.append(
            f"| {E} | {smin * 1e3:.2f} / {smed * 1e3:.2f} | {umin * 1e3:.2f} / {umed * 1e3:.2f} | {smed / umed:.2f}x |"
        )
    head = (
        f"Expert weight views, forward+backward of E per-expert [16 x 256] @ [256 x 256]ᵀ GEMMs, fp32, "
        f"{a.reps} alternating reps; {platform.machine()} CPU, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}, load {load0:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    text = head + "\n\n" + "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write("# " + text)


if __name__ == "__main__":
    main()
