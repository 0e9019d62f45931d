"""Training-step benchmark: the engine against Hugging Face transformers, its own step, N-rank layouts.

Modes (``--mode``):

- ``sidebyside`` (default): a random Mixtral config is built as transformers'
  ``MixtralForCausalLM``, saved with ``save_pretrained`` and loaded with ``folding.model.hf.weights.from_hf``
  (its defaults), so both models hold the same weights. Both are driven the same way, alternating in
  one process: ``logits = model(ids)``; cross-entropy of the shifted logits; ``backward()``;
  ``torch.optim.AdamW.step()``. Same batch, dtype and thread count. Also times the engine's own step
  (``model(ids, labels=...)``: its fused vocab-parallel loss) and, unless ``--no-compile``, the engine
  with ``train.compile`` on (its dense parts through ``torch.compile``) in the same alternation.
- ``layouts`` (``benchmarks/train_layouts.py``): the engine's own step on N gloo ranks
  (``folding.testing.RankPool``) for each layout of ``--layouts`` (e.g. ``"tp2;ep2;tp2,ep4,etp1"``),
  and on 1 rank, from the same checkpoint and batch.
- ``gpu``: see ``benchmarks/gpu_mfu.py`` (MFU of Mixtral-8x7B-shaped layers in BF16/FP8 on one GPU).

Each timed step is measured with ``time.perf_counter`` (one warm-up step first, not counted); the
report gives medians, the kernel floor of both models' steps (``benchmarks/floor.py``: the same
matmuls, attention, AdamW and loss timed alone), a PyTorch-profiler breakdown
(``benchmarks/breakdown.py``) of one extra step, the host load average, and the exact command. Nothing
here asserts a timing.

Usage::

    python -m benchmarks.bench_train --seq 1024 --batch 2 --iters 7 --threads 2 \\
        --out benchmarks/results/train_sidebyside_cpu.md
    python -m benchmarks.bench_train --mode layouts --world 4 --seq 256 --batch 4 --iters 3 \\
        --out benchmarks/results/train_layouts_cpu.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.breakdown import format_breakdown
from benchmarks.floor import kernel_floor
from benchmarks.gpu_mfu import main as gpu_main
from benchmarks.train_layouts import run_layouts
from benchmarks.train_step import (
    engine_loss,
    flops_per_step,
    header,
    hf_loss,
    label_engine,
    label_hf,
    make_step,
    mixtral_config,
    profile_step,
)
from folding.model.hf.weights import from_hf

COMPILED = "engine, train.compile=true (common driver)"


def sidebyside(a):
    """Alternate HF, engine (common driver) and engine (own step); medians and breakdowns."""
    from transformers import MixtralForCausalLM

    torch.manual_seed(a.seed)
    hf = MixtralForCausalLM(mixtral_config(a)).float().train()
    tmp = tempfile.mkdtemp(prefix="bench_train_")
    hf.save_pretrained(tmp)
    eng = from_hf(tmp)
    eng_own = from_hf(tmp)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(a.seed))
    steps = {
        "transformers": make_step(hf, hf_loss, ids),
        "engine": make_step(eng, hf_loss, ids),
        "engine (own step, fused loss)": make_step(eng_own, engine_loss, ids),
    }
    if a.compile:
        eng_c = from_hf(tmp, compile_dense=True)
        steps[COMPILED] = make_step(eng_c, hf_loss, ids)
    first = {k: s() for k, s in steps.items()}  # warm-up (and compile), not timed
    times = {k: [] for k in steps}
    for i in range(a.iters):
        for k, s in steps.items():
            t0 = time.perf_counter()
            s()
            times[k].append(time.perf_counter() - t0)
        print(f"iter {i}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    floors = {
        "transformers": kernel_floor(hf, steps["transformers"], a),
        "engine": kernel_floor(eng, steps["engine"], a),
    }
    label_hf(hf), label_engine(eng), label_engine(eng_own)
    prof = {k: profile_step(s) for k, s in steps.items() if k != COMPILED}
    return first, times, {k: v[0] for k, v in prof.items()}, {k: v[1] for k, v in prof.items()}, floors


def kinds_table(kinds) -> str:
    """Markdown: seconds by kind of work per model, and the speed-up bound it implies."""
    names = list(kinds)
    lines = ["| kind of work | " + " | ".join(f"{n} ms" for n in names) + " |", "|---|" + "---|" * len(names)]
    for k in ("gemm", "attention kernels", "optimizer", "rest"):
        lines.append(f"| {k} | " + " | ".join(f"{kinds[n][k] * 1e3:.0f}" for n in names) + " |")
    hf = kinds["transformers"]
    fixed = hf["gemm"] + hf["attention kernels"] + hf["optimizer"]
    lines += [
        "",
        f"In the transformers step, GEMMs + attention kernels + AdamW (the same kernels and FLOPs in "
        f"both models, fp32) are {fixed * 1e3:.0f} ms of {sum(hf.values()) * 1e3:.0f} ms: even with "
        f"all of the rest at zero cost, a model driven this way is at most "
        f"**{sum(hf.values()) / fixed:.2f}x** faster than transformers here.",
    ]
    return "\n".join(lines)


def floor_table(floors, times) -> str:
    """Markdown: the kernel floor of each model's step (``floor.py``) and the speed-up bound it implies."""
    names = list(floors)
    lines = [
        "| piece (timed alone, best of 3) | " + " | ".join(f"{n} ms" for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for k in ("gemm", "attention", "optimizer", "loss"):
        extra = " (" + " / ".join(str(floors[n]["matmuls"]) for n in names) + " matmuls)" if k == "gemm" else ""
        lines.append(f"| {k}{extra} | " + " | ".join(f"{floors[n][k] * 1e3:.0f}" for n in names) + " |")
    tot = {n: sum(floors[n][k] for k in ("gemm", "attention", "optimizer", "loss")) for n in names}
    med = {n: statistics.median(times[n]) for n in names}
    best = {n: min(times[n]) for n in names}
    lines.append("| **floor** | " + " | ".join(f"**{tot[n] * 1e3:.0f}**" for n in names) + " |")
    lines.append(
        "| step (median / best) | " + " | ".join(f"{med[n] * 1e3:.0f} / {best[n] * 1e3:.0f}" for n in names) + " |"
    )
    lines.append(
        "| step − floor (median / best) | "
        + " | ".join(f"{(med[n] - tot[n]) * 1e3:.0f} / {(best[n] - tot[n]) * 1e3:.0f}" for n in names)
        + " |"
    )
    hf = "transformers"
    lines += [
        "",
        f"Bound: a model that did nothing but these kernels would run at most "
        f"**{med[hf] / tot[hf]:.2f}x** (medians) / **{best[hf] / tot[hf]:.2f}x** (best steps) faster than "
        f"transformers' step on this machine.",
    ]
    return "\n".join(lines)


def report_sidebyside(a, argv, first, times, parts, kinds, floors) -> str:
    """Markdown report: medians, ratio, breakdown."""
    tokens, fl = a.batch * a.seq, flops_per_step(a)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["transformers"]
    rows = [
        "| model | first loss | median s/step | min s/step | tokens/s | TFLOP/s | speed vs transformers |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, v in times.items():
        rows.append(
            f"| {k} | {first[k]:.4f} | {med[k]:.3f} | {min(v):.3f} | {tokens / med[k]:.0f} | "
            f"{fl / med[k] / 1e12:.4f} | {base / med[k]:.2f}x |"
        )
    per_iter = [h / e for h, e in zip(times["transformers"], times["engine"])]
    return "\n".join(
        [
            "# Training step: engine vs transformers' MixtralForCausalLM",
            "",
            header(a, argv),
            "",
            "Both models hold the same weights (HF `save_pretrained` -> `from_hf` with its defaults) and see the "
            "same batch; `transformers` and `engine` are driven identically (`logits = model(ids)`, cross-entropy "
            "of the shifted logits, `backward()`, `AdamW.step()`); the third row is the engine's own step "
            "(`model(ids, labels=)`, fused vocab-parallel loss, same mean over the same tokens); the last row, when "
            "present, is the common driver on the engine with `train.compile` on "
            "(`from_hf(..., compile_dense=True)`, `folding.model.compile`: each layer's norm + attention "
            "sublayer through "
            "`torch.compile`; compile time in the untimed warm-up step), "
            "which is not `from_hf`'s default.",
            "",
            *rows,
            "",
            f"Ratio engine/transformers tokens/s: medians **{base / med['engine']:.2f}x**; best steps "
            f"**{min(times['transformers']) / min(times['engine']):.2f}x**; per alternating pair: "
            + ", ".join(f"{r:.2f}" for r in per_iter)
            + f" (median {statistics.median(per_iter):.2f}). "
            "On a loaded, shared host a step is only ever slowed down by other processes, so the best "
            "steps are the least disturbed estimate; when the per-pair ratios scatter widely, neither the "
            "medians nor any single pair are to be trusted, and the breakdown below is the reliable part.",
            "",
            "## Where the time goes (mean of two profiled steps each, PyTorch profiler; forward + backward per part)",
            "",
            "transformers' `MixtralExperts` does its own dispatch and combine, so those land in its `experts` row; "
            "`other` is embedding, norms, output layer, residuals and Python.",
            "",
            format_breakdown(parts),
            "",
            "## By kind of work (same profiled steps; self time of the kernels)",
            "",
            kinds_table(kinds),
            "",
            "## The kernel floor (`benchmarks/floor.py`: the same matmuls, attention, AdamW and loss timed alone, "
            "no profiler)",
            "",
            "Both models must run these kernels: the matmuls of one recorded step replayed with their sizes and "
            "strides, SDPA forward + backward per layer, `AdamW.step()` over the same parameters, and the common "
            "driver's cross-entropy. What a step spends beyond its floor is the model's own overhead "
            "(elementwise kernels, copies, allocation, Python).",
            "",
            floor_table(floors, times),
            "",
        ]
    )


def main(argv=None):
    """Parse arguments, run the mode, print the table last and write the report."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("sidebyside", "layouts", "gpu"), default="sidebyside")
    for name, d in (
        ("hidden", 512),
        ("ffn", 1024),
        ("experts", 8),
        ("topk", 2),
        ("layers", 4),
        ("heads", 8),
        ("kv-heads", 4),
        ("vocab", 8192),
        ("batch", 2),
        ("seq", 1024),
        ("iters", 7),
        ("threads", 2),
        ("seed", 0),
        ("world", 4),
    ):
        p.add_argument(f"--{name}", type=int, default=d)
    p.add_argument("--layouts", default="tp2;ep2;ep4;tp2,ep4,etp1")
    p.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="sidebyside: skip the row of the engine with its dense parts compiled (train.compile)",
    )
    p.add_argument("--out", default=None, help="markdown report path")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.mode == "gpu":
        return gpu_main(argv)
    if a.mode == "sidebyside":
        first, times, parts, kinds, floors = sidebyside(a)
        text = report_sidebyside(a, argv, first, times, parts, kinds, floors)
    else:
        text = run_layouts(a, argv)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
