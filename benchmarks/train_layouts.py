"""``bench_train.py --mode layouts``: the engine's own training step on 1 rank and on N gloo ranks per layout.

For each layout of ``--layouts`` (e.g. ``"tp2;ep2;tp2,ep4,etp1"``) on ``--world`` ranks
(:class:`folding.testing.RankPool`), from the same Hugging Face checkpoint and batch: the median step
time of the slowest rank, tokens/s and TFLOP/s (all ranks and per rank), and a profiler breakdown of
rank 0's step by part (``benchmarks/breakdown.py``). Each data-parallel replica trains on its slice
of the batch.

Usage::

    python -m benchmarks.bench_train --mode layouts --world 4 --seq 256 --batch 4 --iters 3 \\
        --out benchmarks/results/train_layouts_cpu.md
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from benchmarks import train_step
from benchmarks.breakdown import format_breakdown
from folding.model.hf.weights import from_hf
from folding.parallel import ParallelLayout, build_parallel_state
from folding.testing import RankPool


def layout_worker(path, layout_kw, ids, iters, threads):
    """On every rank: the engine's own step in one layout; returns (first loss, step times, breakdown of
    one extra profiled step by part)."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    ps = build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), **layout_kw))
    try:
        model = from_hf(path, parallel_state=ps)
        b = ids.shape[0] // ps.coords.dp.size  # each data-parallel replica its slice of the batch
        step = train_step.make_step(
            model, train_step.engine_loss, ids[ps.coords.dp.rank * b : (ps.coords.dp.rank + 1) * b]
        )
        first = step()
        ts = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
        train_step.label_engine(model)
        dist.barrier()
        parts, _ = train_step.profile_step(step, n=1)
        return first, ts, parts
    finally:
        ps.destroy()


def parse_layout(s: str) -> dict:
    """``"tp2,ep4,etp1"`` -> ``{"tp": 2, "ep": 4, "etp": 1}``."""
    out = {}
    for tok in filter(None, s.split(",")):
        key = tok.rstrip("0123456789")
        if key not in ("tp", "cp", "ep", "etp", "pp") or key == tok:
            raise ValueError(f"--layouts: {tok!r} is not <axis><size> with axis in tp, cp, ep, etp")
        out[key] = int(tok[len(key) :])
    return out


def run_layouts(a, argv) -> str:
    """The engine's own step on 1 rank and on ``--world`` gloo ranks per layout; markdown report."""
    from transformers import MixtralForCausalLM

    torch.manual_seed(a.seed)
    tmp = tempfile.mkdtemp(prefix="bench_layouts_")
    MixtralForCausalLM(train_step.mixtral_config(a)).float().save_pretrained(tmp)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(a.seed))
    fl = train_step.flops_per_step(a)
    rows = [
        "| layout | ranks | first loss | median s/step | tokens/s (all ranks) | TFLOP/s (all ranks) | "
        "TFLOP/s per rank |",
        "|---|---|---|---|---|---|---|",
    ]
    parts = {}

    def row(name, ranks, first, med):
        rows.append(
            f"| {name} | {ranks} | {first:.4f} | {med:.3f} | {a.batch * a.seq / med:.0f} | "
            f"{fl / med / 1e12:.4f} | {fl / med / ranks / 1e12:.4f} |"
        )

    with RankPool(1) as one:
        first, ts, parts["1 rank"] = one.run(layout_worker, tmp, {}, ids, a.iters, a.threads)[0]
        row("1 rank", 1, first, statistics.median(ts))
    with RankPool(a.world) as pool:
        for s in filter(None, a.layouts.split(";")):
            res = pool.run(layout_worker, tmp, parse_layout(s), ids, a.iters, max(1, a.threads // a.world))
            med = statistics.median(max(r[1][i] for r in res) for i in range(a.iters))
            row(s, a.world, res[0][0], med)
            parts[s] = res[0][2]
    return "\n".join(
        [
            "# Engine training step by layout (gloo, CPU)",
            "",
            train_step.header(a, argv),
            "",
            "Step time of a layout = the slowest rank's; each data-parallel replica trains on its slice of the "
            "batch (first loss: rank 0's, equal to the 1-rank loss when DP = 1). No gradient reduction "
            "over DP here: this times the model, not the optimizer's communication. TFLOP/s counts the model "
            "FLOPs of the whole global batch (3x forward matmuls, causal attention halved).",
            "",
            *rows,
            "",
            "## Where rank 0's time goes (one profiled step per layout; forward + backward per part, ms)",
            "",
            "With several ranks on 2 cores, the parts include waiting: a collective on one rank waits for "
            "the others to be scheduled.",
            "",
            format_breakdown(parts),
            "",
        ]
    )
