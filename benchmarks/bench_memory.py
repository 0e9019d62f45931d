"""Per-rank memory as EP grows at a fixed world size, folded and non-folded, against folding/planning.

On ``--world`` gloo ranks (``folding.testing.RankPool``, CPU, bf16 and fp32: ``--dtypes``) and a small
Mixtral, for EP in ``--eps`` (default 1, 2, 4, 8), two attention layouts and two routing modes:

- ``non-folded``: attention ``TP1 DP=world``; EP is carved out of DP (EP <= DP), ETP = 1.
- ``folded``: attention ``TP=--tp`` (sequence parallel), ``DP = world/TP``; EP up to the world,
  ETP = 1 (EP > DP is only possible with folding).
- ``--routing balanced``: the MoE layers run with ``MoEConfig.force_balance`` (round-robin expert
  choice, every expert gets the same rows; probabilities and gradients still come from the router),
  so what changes with EP is the engine's own memory, not the routing's imbalance.
- ``--routing learned``: the (untrained, random) router decides; dropless routing is then unbalanced
  and the rank holding the busiest expert carries more rows. Both are run by default.

One training step is the engine's own: ``model(ids, labels=)`` (fused loss), the loss sum over the
global token count, ``backward()``, :class:`folding.optim.FoldedOptimizer` (folded gradient
reduction over DP / EDP, clipping, AdamW; ``--distributed`` for ZeRO-1). What is measured per rank:

- ``persistent``: bytes of the distinct storages of parameters, model buffers, fp32 main gradients
  and optimizer state after a warm-up step (so AdamW state exists) and ``zero_grad()``.
- ``true peak``: ``persistent`` plus the peak increase of live CPU tensor bytes during a second,
  profiled step (forward, backward, optimizer), replayed from the profiler's allocation events
  (``benchmarks/memory_probe.py``): every tensor counts, activations, dispatcher send/receive
  buffers, all-to-all staging, gradients in flight, temporaries. ``net`` is the step's net change
  of live bytes (about 0 when nothing persistent was replaced; see the probe's docstring).
- ``saved``: the largest total of distinct storages autograd saved for backward during forward
  (a saved-tensor hook; parameters excluded): the activation part of the peak, for comparison with
  the analytic model's activation term.
- ``phase``: where the peak happened (forward, backward or optimizer) on the rank with the peak.

The analytic columns are ``folding.planning.memory.memory_per_rank`` for the same layout (the dtype's
parameters and activations, ``fused_swiglu=True`` as the engine runs, ``distributed`` as measured).
``--explain`` re-runs the balanced EP1 and EP-max layouts with Python stacks and lists the largest
allocations alive at the peak, with the function that made them.

Usage::

    python -m benchmarks.bench_memory --out benchmarks/results/memory_ep_cpu.md
    python -m benchmarks.bench_memory --routing balanced --eps 1,8 --explain
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import sys
import time

import torch

from benchmarks.memory_probe import PeakProbe, storage_bytes
from folding.model.presets import get_preset
from folding.model.transformer import MoETransformer
from folding.moe.settings import LayerSettings
from folding.optim import FoldedOptimizer, OptimConfig
from folding.parallel import ParallelLayout, build_parallel_state
from folding.planning.memory import memory_per_rank
from folding.testing import RankPool

MiB = 2.0**20
ROUTINGS = ("balanced", "learned")


def model_config(a):
    """The benchmark's architecture: the ``mixtral_tiny`` preset at the requested sizes."""
    return get_preset(
        "mixtral_tiny",
        hidden_size=a.hidden,
        num_layers=a.layers,
        vocab_size=a.vocab,
        moe={"ffn_hidden_size": a.ffn, "aux_loss_coeff": 0.0},
    )


def _frame(stack, top: int = 2) -> str:
    """Where an allocation came from: the innermost ``top`` engine frames (``folding/``) and the op or
    backward node that made it (``stack`` from a ``with_stack`` profile, outermost first)."""
    own = [s.split("folding/")[-1] for s in stack if "folding/" in s and ".py(" in s and "testing/rank_pool" not in s]
    nodes = [s.split(": ", 1)[-1] for s in stack if s.startswith("autograd::engine::evaluate_function")]
    ops = [s for s in stack if s.startswith("aten::")]
    op = nodes[-1] + " (backward)" if nodes else (ops[0] if ops else "?")
    return (" < ".join(reversed(own[-top:])) + " · " if own else "") + op


def measure(cfg, layout_kw, seq, batch, seed, routing, distributed, explain_top=0, dtype="fp32"):
    """On every rank: a warm-up step, then a profiled step; returns measured and analytic bytes. ``dtype``:
    ``fp32`` or ``bf16`` parameters and activations (bf16: fp32 master weights and main gradients, as
    ``train.precision=bf16``)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    layout = ParallelLayout(world_size=dist.get_world_size(), **layout_kw)
    ps = build_parallel_state(layout)
    try:
        cfg = cfg.replace(moe={"force_balance": routing == "balanced"})
        width = 2 if dtype == "bf16" else 4
        settings = LayerSettings(init_seed=seed, params_dtype=torch.bfloat16 if width == 2 else torch.float32)
        model = MoETransformer(cfg, parallel_state=ps, settings=settings)
        opt = FoldedOptimizer(
            model, OptimConfig(lr=1e-4, decay_style="constant", distributed=distributed), parallel_state=ps
        )
        gen = torch.Generator().manual_seed(seed + ps.coords.dp.rank)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
        labels = torch.roll(ids, -1, 1)
        global_tokens = batch * seq * layout.dp * layout.cp
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved, marks = [0, set()], {}

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key not in params and key not in saved[1]:
                saved[1].add(key)
                saved[0] += t.untyped_storage().nbytes()
            return t

        def step():
            opt.zero_grad()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(ids, labels=labels).sum() / global_tokens
            marks["backward"] = time.time_ns()
            loss.backward()
            marks["optimizer"] = time.time_ns()
            opt.clip_and_step()

        step()  # warm-up: state exists
        opt.zero_grad()
        gc.collect()
        state = [x for st in opt.state for ts in st.values() for t in ts for x in (t.data, t.scale) if x is not None]
        persistent = storage_bytes([*model.parameters(), *model.buffers(), *(b.main_grad for b in opt.buffers), *state])
        saved[0], saved[1] = 0, set()
        dist.barrier()
        with PeakProbe(with_stack=explain_top > 0) as probe:
            step()
        r = probe.result
        phase = (
            "forward"
            if r.peak_time_ns < marks["backward"]
            else "backward"
            if r.peak_time_ns < marks["optimizer"]
            else "optimizer"
        )
        est = memory_per_rank(
            cfg,
            layout,
            param_bytes=width,
            distributed=distributed,
            seq_length=seq,
            micro_batch_size=batch,
            act_bytes=width,
            fused_swiglu=True,
        )
        out = {
            "persistent": persistent,
            "peak_delta": r.peak_bytes,
            "net": r.end_bytes,
            "saved": saved[0],
            "phase": phase,
            **{f"meas_{k}": v for k, v in opt.memory_bytes().items()},
            **{f"est_{k}": v for k, v in est.by_part().items()},
            "est_total": est.total,
        }
        if explain_top:
            out["top"] = [(a.size, _frame(a.stack)) for a in r.live_at_peak[:explain_top]]
        return out
    finally:
        ps.destroy()


def layouts(a, num_experts):
    """``(name, ep, layout kwargs)`` for every legal combination of the sweep."""
    out = [("non-folded (TP1)", ep, dict(tp=1, ep=ep, etp=1)) for ep in a.eps]
    out += [(f"folded (TP{a.tp})", ep, dict(tp=a.tp, ep=ep, etp=1)) for ep in a.eps]
    return [
        (n, ep, kw)
        for n, ep, kw in out
        if a.world % (ep * kw["etp"]) == 0 and num_experts % ep == 0 and a.world % kw["tp"] == 0
    ]


def _pct(new, old) -> str:
    return f"{100 * (new / old - 1):+.1f}%"


def _row(routing, dtype, name, ep, kw, a, res):
    """One table row and the numbers the trend lines need."""
    peaks = [r["persistent"] + r["peak_delta"] for r in res]
    top = res[max(range(len(res)), key=peaks.__getitem__)]
    work = [r["peak_delta"] for r in res]
    saved = [r["saved"] for r in res]
    est_pers = top["est_params"] + top["est_grads"] + top["est_optimizer"]
    peak, mean = max(peaks), sum(peaks) / len(peaks)
    cells = [
        routing,
        dtype,
        name,
        str(ep),
        str(a.world // (ep * kw["etp"])),
        f"{top['persistent'] / MiB:.2f} ({est_pers / MiB:.2f})",
        f"{max(saved) / MiB:.2f} / {sum(saved) / len(saved) / MiB:.2f} ({top['est_activations'] / MiB:.2f})",
        f"{max(work) / MiB:.2f} ({(top['est_activations'] + top['est_transient']) / MiB:.2f})",
        f"{max(abs(r['net']) for r in res) / MiB:.2f}",
        f"{peak / MiB:.2f}",
        f"{mean / MiB:.2f}",
        f"{top['est_total'] / MiB:.2f}",
        f"{peak / top['est_total']:.2f}",
        top["phase"],
    ]
    return "| " + " | ".join(cells) + " |", dict(
        peak=peak, mean=mean, work=max(work), saved=max(saved), saved_mean=sum(saved) / len(saved)
    )


HEADER = [
    "| routing | dtype | layout | EP | EDP | persistent MiB (model) | saved for backward MiB, max / mean "
    "(model activations) | step working set MiB, max (model act. + transient) | max abs net MiB | "
    "true peak MiB, max rank | true peak, mean of ranks | model total MiB | peak / model | peak in |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def main(argv=None):
    """Run the sweep on ``--world`` ranks, print the table last and write the report."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, d in (
        ("world", 8),
        ("tp", 2),
        ("hidden", 64),
        ("ffn", 192),
        ("layers", 2),
        ("vocab", 512),
        ("seq", 128),
        ("batch", 2),
        ("seed", 0),
    ):
        p.add_argument(f"--{name}", type=int, default=d)
    p.add_argument("--eps", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    p.add_argument(
        "--routing",
        choices=("both",) + ROUTINGS,
        default="both",
        help="balanced: MoEConfig.force_balance (engine memory alone); learned: the random router",
    )
    p.add_argument("--distributed", action="store_true", help="ZeRO-1 optimizer (optim.distributed)")
    p.add_argument(
        "--dtypes",
        default="bf16,fp32",
        help="parameter and activation dtypes to sweep, comma-separated: bf16 (fp32 master weights), fp32",
    )
    p.add_argument(
        "--explain",
        type=int,
        nargs="?",
        const=8,
        default=0,
        metavar="N",
        help="list the N largest allocations alive at the peak, balanced routing, first and last EP",
    )
    p.add_argument("--out", default=None, help="markdown report to write")
    a = p.parse_args(argv)

    cfg = model_config(a)
    plan = layouts(a, cfg.moe.num_experts)
    if not plan:
        raise SystemExit(
            f"--eps {a.eps} with --world {a.world} --tp {a.tp}: no legal layout "
            f"(EP must divide the world and the {cfg.moe.num_experts} experts)"
        )
    routings = ROUTINGS if a.routing == "both" else (a.routing,)
    rows, stats, explain = list(HEADER), {}, []
    t0 = time.time()
    with RankPool(a.world) as pool:
        for dtype in a.dtypes.split(","):
            for routing in routings:
                for name, ep, kw in plan:
                    res = pool.run(measure, cfg, kw, a.seq, a.batch, a.seed, routing, a.distributed, 0, dtype)
                    row, st = _row(routing, dtype, name, ep, kw, a, res)
                    rows.append(row)
                    stats.setdefault((routing, dtype, name), []).append((ep, st))
                    print(row, flush=True)
        if a.explain:
            eps = sorted({ep for _, ep, _ in plan})
            for name, ep, kw in plan:
                if ep in (eps[0], eps[-1]):
                    res = pool.run(measure, cfg, kw, a.seq, a.batch, a.seed, "balanced", a.distributed, a.explain)
                    top = max(res, key=lambda r: r["persistent"] + r["peak_delta"])
                    explain += [
                        f"Largest allocations alive at the peak, **{name} EP{ep}** (balanced; rank "
                        f"with the peak, peak in {top['phase']}, working set "
                        f"{top['peak_delta'] / MiB:.2f} MiB):",
                        "",
                        "| KiB | allocated by |",
                        "|---|---|",
                        *[f"| {size / 1024:.1f} | `{where}` |" for size, where in top["top"]],
                        "",
                    ]
    trend = []
    for (routing, dtype, name), vals in stats.items():
        (e0, s0), (e1, s1) = vals[0], vals[-1]
        trend.append(
            f"- {routing}, {dtype}, {name}, EP{e0} -> EP{e1}: true peak (max rank) {_pct(s1['peak'], s0['peak'])} "
            f"({s0['peak'] / MiB:.2f} -> {s1['peak'] / MiB:.2f} MiB), mean of ranks "
            f"{_pct(s1['mean'], s0['mean'])}; step working set {_pct(s1['work'], s0['work'])}; "
            f"saved for backward max {_pct(s1['saved'], s0['saved'])}, mean "
            f"{_pct(s1['saved_mean'], s0['saved_mean'])}"
        )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    text = "\n".join(
        [
            "# Per-rank memory as EP grows (fixed world size)",
            "",
            f"- device: CPU, gloo, {a.world} ranks on {os.cpu_count()} cores ({platform.machine()}), {a.dtypes}; "
            f"torch {torch.__version__}; load average at the end {load:.1f}; sweep took {time.time() - t0:.0f} s",
            f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            f"- command: `python -m benchmarks.bench_memory {' '.join(argv)}`",
            f"- model: mixtral_tiny with H={a.hidden} F={a.ffn} E={cfg.moe.num_experts} top-{cfg.moe.topk} "
            f"layers={a.layers} "
            f"vocab={a.vocab}; micro-batch {a.batch} x seq {a.seq} per data-parallel rank; one step = fused-loss "
            f"forward, backward, FoldedOptimizer (AdamW, {'ZeRO-1' if a.distributed else 'not distributed'})",
            "- true peak = persistent bytes (parameters, buffers, main grads, optimizer state) + the largest "
            "increase of live CPU tensor bytes during one profiled step (profiler allocation events: every "
            "tensor, transients included). Working set = that increase. Net = the step's net change (~0 "
            "expected). Saved for backward = storages autograd kept (saved-tensor hook).",
            "- in parentheses: `folding.planning.memory.memory_per_rank` (param_bytes and act_bytes of the "
            "dtype: 2 for bf16 with fp32 master weights, 4 for fp32; fused_swiglu=True)",
            "",
            *explain,
            *rows,
            "",
            *trend,
        ]
    )
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
