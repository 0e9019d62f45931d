"""Expert load imbalance and hot-expert replicas, measured on CPU (gloo ranks).

A small MoE (``--layers`` MoE layers with residuals, random tokens, a squared-output loss, SGD) whose
routers are biased to a zipf skew: a fixed bias ``-S·ln(rank+1)`` is added to the router logits, the
popularity rank of each expert drawn from a seeded permutation, to token-dependent logits scaled to a
standard Gumbel's spread, so expert popularity follows zipf ``S`` (exactly so for top-1 with Gumbel
noise) while the routing still depends on the tokens. For each EP size of ``--ep`` on ``--world``
ranks, two copies of the same model (same weights, same tokens) train side by side in one run, steps
alternating: without replicas and with ``--replicas`` slots per EP rank re-planned every
``--interval`` steps (``moe.expert_replicas``, ``moe.replica_interval``). Per step it prints and
reports: max/mean rows per EP rank (the rows its expert GEMMs compute), the step time (slowest rank,
wall clock), and the time in the expert GEMMs (forward + backward) on the slowest rank, as wall clock
and as the rank's own CPU time (which the other processes sharing the cores do not inflate). The
steps before the first plan are warm-up for both models and left out of the medians.

Usage::

    python -m benchmarks.bench_imbalance --skew zipf:1.2 --replicas 2 --experts 16 --ep 4 --world 4
    python -m benchmarks.bench_imbalance --skew zipf:1.2 --replicas 2 --experts 16 --ep 4,8 --world 8

(``benchmarks/results/imbalance_cpu.md`` gathers three such runs.)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from folding.moe.config import MoEConfig
from folding.moe.layer import build_moe_layer
from folding.moe.replicas.table import ReplicaSchedule
from folding.moe.settings import LayerSettings
from folding.parallel import ParallelLayout, build_parallel_state
from folding.testing import RankPool


def parse_skew(s: str) -> float:
    """``"zipf:S"`` -> ``S``."""
    kind, _, value = s.partition(":")
    if kind != "zipf" or not value:
        raise SystemExit(f"--skew {s!r}: expected zipf:S, e.g. zipf:1.2")
    return float(value)


class _Stamp(torch.autograd.Function):
    """Identity that records when its gradient passes (backward timing of the experts)."""

    @staticmethod
    def forward(ctx, x, clocks, key):
        ctx.clocks, ctx.key = clocks, key
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        now = (time.perf_counter(), time.thread_time())
        if ctx.key == "start":  # the gradient reached the experts' output
            ctx.clocks["bwd_t0"] = now
        else:  # ... and left through their input: add this layer's expert backward
            t0 = ctx.clocks["bwd_t0"]
            ctx.clocks["bwd"] = [a + n - b for a, n, b in zip(ctx.clocks.get("bwd", (0.0, 0.0)), now, t0)]
        return g, None, None


def _instrument(layer, clocks: dict) -> None:
    """Time ``layer.experts`` (forward and backward) and count its rows into ``clocks``."""
    experts = layer.experts
    orig = experts.forward

    def timed(tokens_NH, record, probs_N, replica_weights=None):
        clocks["rows"] = clocks.get("rows", 0) + sum(record.tokens_per_expert_host)
        t0 = (time.perf_counter(), time.thread_time())
        x = _Stamp.apply(tokens_NH, clocks, "end")
        y = orig(x, record, probs_N, replica_weights)
        t1 = (time.perf_counter(), time.thread_time())
        clocks["fwd"] = [a + b - c for a, b, c in zip(clocks.get("fwd", (0.0, 0.0)), t1, t0)]
        return _Stamp.apply(y, clocks, "start")

    experts.forward = timed


def _bias_router(layer, bias_E: torch.Tensor) -> None:
    """Add a fixed bias to the router's logits (what a skewed router's learned weights do)."""
    router = layer.router
    route = router._route
    router._route = lambda logits_TE: route(logits_TE + bias_E.to(logits_TE.dtype))


def _build(args, ps, replicas: int, bias_E):
    cfg = MoEConfig(
        num_experts=args.experts,
        topk=args.topk,
        ffn_hidden_size=args.ffn,
        expert_backend="torch",
        expert_replicas=replicas,
        replica_interval=args.interval,
    )
    layers = torch.nn.ModuleList(
        build_moe_layer(
            config=cfg,
            hidden_size=args.hidden,
            groups=ps.groups,
            layer_number=i,
            settings=LayerSettings(init_seed=3),
            init_std=args.init_std,
        )
        for i in range(args.layers)
    )
    for layer in layers:
        # router logits of std ~1.28 (a standard Gumbel's), so that top-1 popularity ~ exp(bias): zipf S
        with torch.no_grad():
            layer.router.weight.mul_(1.28 / (args.init_std * args.hidden**0.5))
        _bias_router(layer, bias_E)
    return layers


def worker(args, ep: int):
    """On every rank: both models of one EP size; per step (rows per rank, step time, expert wall
    time, expert CPU time) for each."""
    torch.set_num_threads(1)
    S = parse_skew(args.skew)
    perm = torch.randperm(args.experts, generator=torch.Generator().manual_seed(args.seed))
    bias_E = -S * torch.log1p(perm.to(torch.float64))  # expert e has popularity rank perm[e]
    ps = build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), ep=ep, etp=1))
    try:
        runs = {}
        for name, R in (("without", 0), ("with", args.replicas)):
            layers = _build(args, ps, R, bias_E)
            clocks: dict = {}
            for layer in layers:
                _instrument(layer, clocks)
            sched = ReplicaSchedule(layers, interval=args.interval) if R else None
            opt = torch.optim.SGD(layers.parameters(), lr=args.lr)
            runs[name] = (layers, clocks, sched, opt, [])
        g = torch.Generator().manual_seed(1000 + dist.get_rank())
        for step in range(args.steps):
            x = torch.randn(args.tokens, args.hidden, generator=g)
            for name in ("without", "with"):
                layers, clocks, sched, opt, rec = runs[name]
                clocks.clear()
                dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                h = x
                for layer in layers:
                    h = h + layer(h)
                loss = h.pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                dt, dc = time.perf_counter() - t0, time.thread_time() - c0
                if sched is not None:  # the step's loads over all ranks: untimed, as the trainer reuses the
                    # world all-reduce of its step statistics for them
                    counts = torch.stack([layer.take_routing_stats().tokens_per_expert_E.double() for layer in layers])
                    dist.all_reduce(counts)
                    sched.observe({layer.layer_number: counts[i] for i, layer in enumerate(layers)})
                bwd = clocks["bwd"]
                rec.append((clocks["rows"], dt, clocks["fwd"][0] + bwd[0], clocks["fwd"][1] + bwd[1], dc))
        tables = [tuple(layer.replica_table) for layer in runs["with"][0]]
        return {name: run[4] for name, run in runs.items()}, tables
    finally:
        ps.destroy()


def summarize(per_rank, warmup: int):
    """Per step over ranks: (max/mean rows, slowest step time, slowest expert wall, slowest expert CPU,
    largest step CPU time, step CPU time summed over ranks)."""
    out = {}
    for name in ("without", "with"):
        steps = []
        for s in range(len(per_rank[0][0][name])):
            recs = [r[0][name][s] for r in per_rank]
            rows = [x[0] for x in recs]
            steps.append(
                (max(rows) / (sum(rows) / len(rows)),)
                + tuple(max(x[i] for x in recs) for i in (1, 2, 3, 4))
                + (sum(x[4] for x in recs),)
            )
        kept = steps[warmup:]
        med = [statistics.median(x[i] for x in kept) for i in range(6)]
        out[name] = (steps, med)
    return out


def main(argv=None):
    """Run the benchmark and write the markdown report (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skew", default="zipf:1.2", help="router skew: zipf:S")
    p.add_argument("--replicas", type=int, default=2, help="replica slots per EP rank (moe.expert_replicas)")
    p.add_argument("--interval", type=int, default=2, help="steps between re-plans (moe.replica_interval)")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--ep", default="4,8", help="EP sizes, comma-separated")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank per step")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--init-std", type=float, default=0.02, help="std of the initial weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="markdown report path")
    args = p.parse_args(argv)
    parse_skew(args.skew)
    load0 = os.getloadavg()
    pool = RankPool(args.world, start_timeout_s=900, collective_timeout_s=1800)
    sections = []
    try:
        for ep in [int(e) for e in args.ep.split(",")]:
            res = pool.run(worker, args, ep, timeout_s=1800)
            summ = summarize(res, warmup=args.interval)
            sections.append((ep, summ, res[0][1]))
            for name in ("without", "with"):
                steps, med = summ[name]
                print(f"EP{ep} {name} replicas:")
                for s, (ratio, dt, ew, ec, sc, tc) in enumerate(steps, 1):
                    print(
                        f"  step {s:2d}  max/mean rows {ratio:.3f}  step {dt * 1e3:7.1f} ms (cpu max {sc * 1e3:6.1f}, "
                        f"sum {tc * 1e3:7.1f})  experts {ew * 1e3:7.1f} ms wall {ec * 1e3:7.1f} ms cpu"
                    )
                print(
                    f"  median (steps {args.interval + 1}-{args.steps}): max/mean {med[0]:.3f}  "
                    f"step {med[1] * 1e3:.1f} ms "
                    f"(cpu max {med[4] * 1e3:.1f}, sum {med[5] * 1e3:.1f})  experts {med[2] * 1e3:.1f} ms wall "
                    f"{med[3] * 1e3:.1f} ms cpu"
                )
    finally:
        pool.shutdown()
    load1 = os.getloadavg()
    report = _report(args, sections, load0, load1, argv)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


def _report(args, sections, load0, load1, argv) -> str:
    cmd = "python -m benchmarks.bench_imbalance " + " ".join(argv if argv is not None else os.sys.argv[1:])
    lines = [
        "# Expert load imbalance and hot-expert replicas (gloo, CPU)",
        "",
        f"- device: CPU ({platform.machine()}, {os.cpu_count()} cores visible), 1 torch thread per rank, fp32, "
        f"{args.world} ranks",
        f"- torch {torch.__version__}, python {platform.python_version()}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- host load average (1/5/15 min) before: {' / '.join(f'{x:.1f}' for x in load0)}, after: "
        f"{' / '.join(f'{x:.1f}' for x in load1)} on {os.cpu_count()} CPUs",
        f"- command: `{cmd}`",
        f"- model: {args.layers} MoE layers, H={args.hidden} F={args.ffn} E={args.experts} top-{args.topk}, "
        f"{args.tokens} tokens per rank per step, init std {args.init_std}, SGD lr {args.lr}; "
        f"router logits biased to {args.skew} "
        f"(popularity ranks from a seeded permutation, seed {args.seed})",
        f"- replicas: {args.replicas} slots per EP rank, re-planned every {args.interval} steps; medians over "
        f"steps {args.interval + 1}-{args.steps} (both models)",
        "",
        "Rows per EP rank: the rows its expert GEMMs compute (all layers); max/mean over the ranks. Step: the "
        "slowest rank's wall time; step CPU: the rank's own CPU time in the step (a rank waiting in a "
        "collective uses none), the largest over the ranks and the sum. Experts: forward + backward of the "
        "expert GEMMs on the slowest rank, wall "
        "clock and the rank's own CPU time (thread time: not inflated by other processes on shared cores).",
        "",
        "| EP | replicas | max/mean rows per EP rank | median step ms (wall) | median step ms (CPU, slowest rank) "
        "| median step ms (CPU, sum of ranks) | median expert ms (wall) | median expert ms (CPU) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ep, summ, _ in sections:
        for name, R in (("without", 0), ("with", args.replicas)):
            med = summ[name][1]
            lines.append(
                f"| {ep} | {R} | {med[0]:.3f} | {med[1] * 1e3:.1f} | {med[4] * 1e3:.1f} | {med[5] * 1e3:.1f} | "
                f"{med[2] * 1e3:.1f} | {med[3] * 1e3:.1f} |"
            )
    lines += ["", "Reading (computed from the medians above):", ""]
    for ep, summ, _ in sections:
        a, b = summ["without"][1], summ["with"][1]
        lines.append(
            f"- EP{ep}: max/mean rows per EP rank {a[0]:.3f} without replicas, {b[0]:.3f} with; wall step time "
            f"{'lower' if b[1] < a[1] else 'not lower'} with replicas ({b[1] * 1e3:.0f} vs {a[1] * 1e3:.0f} ms); "
            f"the slowest rank's step CPU time {b[4] * 1e3:.0f} vs {a[4] * 1e3:.0f} ms, its expert CPU time "
            f"{b[3] * 1e3:.0f} vs {a[3] * 1e3:.0f} ms; "
            f"all ranks' step CPU time {b[5] * 1e3:.0f} vs {a[5] * 1e3:.0f} ms "
            "(the replicas' own cost: weight exchange, split, more rows crossing EP)."
        )
    cores = os.cpu_count() or 1
    if args.world > cores:
        lines += [
            "",
            f"{args.world} ranks share {cores} cores here (and the host's other load): the ranks take turns "
            "on the cores, so the wall step time follows the CPU time summed over the ranks, which balancing "
            "does not lower, rather than the slowest rank's, which it does. With a core (or GPU) per rank the "
            "step waits for the slowest rank: its CPU time is the measure of what replicas buy there.",
        ]
    for ep, summ, tables in sections:
        lines += [
            "",
            f"## EP{ep} per step",
            "",
            f"Slot tables at the end (per layer, slot → expert, -1 empty): {tables}",
            "",
        ]
        lines += [
            "| step | max/mean without | max/mean with | step ms without | step ms with "
            "| expert ms without (wall/CPU) | expert ms with (wall/CPU) |",
            "|---|---|---|---|---|---|---|",
        ]
        for s, (a, b) in enumerate(zip(summ["without"][0], summ["with"][0]), 1):
            lines.append(
                f"| {s} | {a[0]:.3f} | {b[0]:.3f} | {a[1] * 1e3:.1f} | {b[1] * 1e3:.1f} | "
                f"{a[2] * 1e3:.1f} / {a[3] * 1e3:.1f} | {b[2] * 1e3:.1f} / {b[3] * 1e3:.1f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
