"""folding's all-to-all dispatcher against Megatron-Core's, side by side on the same gloo ranks.

Each iteration times, one after the other in the same processes (alternating, so load drifts hit
all alike, in an order that rotates every iteration), forward and backward of dispatch + a stand-in
expert (``rows·1.5 + probs``) + combine for Megatron-Core's ``MoEAlltoAllTokenDispatcher``, for
folding's (default, and with ``per_expert_exchange=True``: one all-to-all per local expert, no
sort), and the raw floor: the four ``all_to_all_single`` calls a forward and backward must make at
least (dispatch and combine rows, and their gradients) with the same split sizes and no other work.
A time is the slowest rank's (a barrier before each). The report gives min and median per layout,
the ratios folding/Megatron-Core and folding/raw, the ratio of CPU time summed over the ranks (user
and system, every thread: on a machine with fewer CPUs than ranks the wall time follows it), the
machine's CPUs and load.

Allocation: on GPU the caching allocator hands a freed activation buffer back to the next request;
on CPU glibc returns large freed blocks to the kernel and the next iteration page-faults them in
again (about 0.8 ms per 8 MiB on the development machine), a cost of the benchmark host that the
dispatchers' own buffers pay and the raw floor's preallocated buffers do not. By default the rank
processes run with glibc keeping freed memory (``MALLOC_MMAP_THRESHOLD_`` at its 32 MiB maximum,
``MALLOC_TRIM_THRESHOLD_`` at 4 GiB), as a caching allocator would; ``--system-malloc`` keeps glibc's
defaults. The report says which, and ``--both`` measures both in one report.

Keeping freed memory is not enough on its own: glibc places small long-lived allocations inside
freed large blocks, so a later large request may not fit and the heap grows into pages never touched
before; each such page faults on first touch (about 20 us per 4 KiB page on the development machine,
300-700 pages per rank per iteration, landing on whichever variant happens to allocate then). With
freed memory kept, each rank therefore first touches and frees ``--prefault-mib`` (default 512) of
heap in 16 MiB blocks, under the 32 MiB mmap threshold, so that later growth reuses touched pages, as
a warmed-up caching allocator serves requests from the segments it already holds.

With ``--bounds`` the EP-only layout also times, in the same alternation, the reference points of
``benchmarks/dispatch_bounds.py``: the least work a dispatcher can do, adding one requirement at a
time (token movement, expert-major sort, probabilities, count exchange), each reported against the
raw floor and Megatron-Core.

Usage::

    python -m benchmarks.bench_dispatcher_vs_megatron                       # EP4 and EP2xETP2, 4 ranks
    python -m benchmarks.bench_dispatcher_vs_megatron --both                # cached and system malloc
    python -m benchmarks.bench_dispatcher_vs_megatron --bounds              # plus the reference points
    python -m benchmarks.bench_dispatcher_vs_megatron --tokens 2048 --hidden 512 --experts 16 --iters 20
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.dispatch_bounds import bound_variants
from folding.interop.megatron.stages import MegatronDispatcher
from folding.moe.dispatch.build import TokenDispatcher, build_dispatcher
from folding.moe.routing.functions import topk_routing
from folding.testing.rank_pool import RankPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LAYOUTS = {"EP4": dict(tp=1, ep=4, etp=1), "EP2xETP2": dict(tp=1, ep=2, etp=2)}
MALLOC_CACHE = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


def _timed(fn):
    """``(wall, cpu)`` seconds of ``fn``: the slowest rank's wall time, and the CPU time (user and
    system, every thread, gloo's included) summed over the ranks."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    c1, t1 = time.process_time(), time.perf_counter()
    mine = torch.tensor([t1 - t0, c1 - c0], dtype=torch.float64)
    every = torch.empty(dist.get_world_size() * 2, dtype=torch.float64)
    dist.all_gather_into_tensor(every, mine)
    every = every.view(-1, 2)
    return float(every[:, 0].max()), float(every[:, 1].sum())


def _run(d, x0, rmap, probs0, g):
    x, probs = x0.clone().requires_grad_(), probs0.clone().requires_grad_()
    d = MegatronDispatcher(d) if isinstance(d, TokenDispatcher) else d  # Megatron-Core's own: as it is
    h, p = d.dispatch_preprocess(x, rmap, probs)
    h, p = d.token_dispatch(h, p)
    rows, _, rp = d.dispatch_postprocess(h, p)
    y = d.combine_postprocess(d.token_combine(d.combine_preprocess(rows * 1.5 + rp.unsqueeze(-1))))
    (y * g).sum().backward()


def _prefault_heap(mib: int) -> None:
    """Touch ``mib`` MiB of heap in 16 MiB blocks, then free them (kept, not returned: see the module
    docstring), so that later allocations land on pages already mapped."""
    blocks = [torch.ones(4 << 20) for _ in range(mib // 16)]  # 16 MiB of fp32 each, under the mmap threshold
    del blocks


def on_rank(layout, tokens, hidden, experts, topk, iters, warmup, threads, prefault_mib=0, bounds=False):
    """Per iteration, ``(wall, cpu)``: each ``{"megatron": [...], "folding": [...], "per_expert": [...],
    "raw": [...]}`` (the slowest rank's wall seconds; CPU seconds summed over the ranks), plus the
    variants of ``dispatch_bounds`` when ``bounds`` is set and the layout has no ETP."""
    torch.set_num_threads(threads)
    if prefault_mib:
        _prefault_heap(prefault_mib)
    from megatron.core import parallel_state as mps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.megatron_cpu import destroy_megatron, init_megatron

    init_megatron(**layout)
    try:
        cfg = TransformerConfig(
            num_layers=1,
            hidden_size=hidden,
            num_attention_heads=4,
            num_moe_experts=experts,
            moe_router_topk=topk,
            expert_model_parallel_size=layout["ep"],
            expert_tensor_parallel_size=layout["etp"],
            moe_token_dispatcher_type="alltoall",
            add_bias_linear=False,
            use_cpu_initialization=True,
        )
        L = experts // layout["ep"]
        first = mps.get_expert_model_parallel_rank() * L
        md = MoEAlltoAllTokenDispatcher(
            L, list(range(first, first + L)), cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
        )
        kw = dict(num_experts=experts, topk=topk, ep_group=md.ep_group, etp_group=md.tp_group)
        fd = build_dispatcher("alltoall", **kw)
        fe = build_dispatcher("alltoall", per_expert_exchange=True, **kw)  # one all-to-all per local expert
        gen = torch.Generator().manual_seed(dist.get_rank())
        x = torch.randn(tokens, hidden, generator=gen)
        probs, rmap = topk_routing(torch.randn(tokens, experts, generator=gen), topk=topk)
        g = torch.randn(tokens, hidden, generator=gen)
        # the raw floor: this rank's real split sizes over EP, four all-to-alls of hidden rows
        _run(fd, x, rmap, probs, g)
        plan = fd.dispatch(x, rmap, probs)[1].plan  # this rank's split sizes (the record of one call)
        send, recv = list(plan.input_splits), list(plan.output_splits)
        a = torch.randn(sum(send), hidden)
        b = torch.empty(sum(recv), hidden)

        def raw():
            for src, dst, s_in, s_out in ((a, b, send, recv), (b, a, recv, send)) * 2:
                dist.all_to_all_single(dst, src, s_out, s_in, group=md.ep_group)

        variants = [
            ("megatron", lambda: _run(md, x, rmap, probs, g)),
            ("folding", lambda: _run(fd, x, rmap, probs, g)),
            ("per_expert", lambda: _run(fe, x, rmap, probs, g)),
            ("raw", raw),
        ]
        if bounds and layout["etp"] == 1:
            variants += bound_variants(x, rmap, probs, g, group=md.ep_group, plan=plan)
        times = {name: [] for name, _ in variants}
        cpu = {name: [] for name, _ in variants}
        for i in range(warmup + iters):
            k = i % len(variants)  # the order rotates: no variant always runs first, or after another
            for name, fn in variants[k:] + variants[:k]:
                t, c = _timed(fn)
                if i >= warmup:
                    times[name].append(t)
                    cpu[name].append(c)
        return times, cpu
    finally:
        destroy_megatron()


def main(argv=None) -> int:
    """Run every layout, print the table, write the report; 0 on success."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank (default 2048)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--report", default=os.path.join(ROOT, "benchmarks", "results", "dispatcher_vs_megatron_cpu.md"))
    ap.add_argument("--system-malloc", action="store_true", help="glibc's default trim/mmap thresholds")
    ap.add_argument("--both", action="store_true", help="measure with the cached and the system malloc")
    ap.add_argument(
        "--prefault-mib", type=int, default=512, help="heap touched up front with freed memory kept (0: none)"
    )
    ap.add_argument(
        "--bounds",
        action="store_true",
        help="also time the reference points of benchmarks/dispatch_bounds.py (EP-only layout) in the same run",
    )
    a = ap.parse_args(argv)

    def measure(cached: bool):
        saved = {k: os.environ.get(k) for k in MALLOC_CACHE}
        if cached:
            os.environ.update(MALLOC_CACHE)
        else:
            for k in MALLOC_CACHE:
                os.environ.pop(k, None)
        rows, bound_lines = [], []
        try:
            with RankPool(4) as pool:  # started after the environment is set: the ranks inherit it
                for name, layout in LAYOUTS.items():
                    t = pool.run(
                        on_rank,
                        layout,
                        a.tokens,
                        a.hidden,
                        a.experts,
                        a.topk,
                        a.iters,
                        a.warmup,
                        a.threads,
                        a.prefault_mib if cached else 0,
                        a.bounds,
                    )
                    t, c = t[0]  # every rank holds the same (gathered) times
                    ratio = lambda d, x, y: statistics.median([p / q for p, q in zip(d[x], d[y])])  # noqa: E731
                    ms = {k: (min(v) * 1e3, statistics.median(v) * 1e3) for k, v in t.items()}
                    rows.append(
                        (
                            name,
                            ms,
                            [ratio(t, a, b) for a, b in (("folding", "megatron"), ("per_expert", "megatron"))]
                            + [ratio(t, a, "raw") for a in ("folding", "per_expert", "megatron")]
                            + [ratio(c, a, "megatron") for a in ("folding", "per_expert")],
                        )
                    )
                    for k in t:
                        if k.startswith("bound_") or (k in ("folding", "megatron") and "bound_move" in t):
                            bound_lines.append(
                                f"| {name} {k} | {ms[k][0]:.2f} / {ms[k][1]:.2f} | {ratio(t, k, 'raw'):.2f} "
                                f"| {ratio(t, k, 'megatron'):.2f} | {ratio(c, k, 'megatron'):.2f} |"
                            )
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        head = (
            "| layout | Megatron-Core ms (min / median) | folding ms | folding per-expert ms | raw a2a floor ms "
            "| folding / Megatron-Core | per-expert / Megatron-Core | folding / raw | per-expert / raw "
            "| Megatron-Core / raw | CPU: folding / Megatron-Core | CPU: per-expert / Megatron-Core |"
        )
        lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, ms, r in rows:
            cells = " | ".join(f"{ms[k][0]:.2f} / {ms[k][1]:.2f}" for k in ("megatron", "folding", "per_expert", "raw"))
            lines.append(f"| {name} | {cells} | " + " | ".join(f"{v:.2f}" for v in r) + " |")
        if bound_lines:
            lines += [
                "",
                "Reference points, same run (`--bounds`, see `benchmarks/dispatch_bounds.py`):",
                "",
                "| variant | ms (min / median) | / raw | / Megatron-Core | CPU / Megatron-Core |",
                "|---|---|---|---|---|",
            ] + bound_lines
        return "\n".join(lines)

    load_before = os.getloadavg()
    runs = [True, False] if a.both else [not a.system_malloc]
    tables = []
    for cached in runs:
        label = "freed memory kept (caching allocator)" if cached else "glibc's default malloc"
        table = measure(cached)
        print(f"{label}:\n{table}")
        tables += [f"### {label}", "", table, ""]
    load_after = os.getloadavg()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    report = [
        "# folding vs Megatron-Core all-to-all dispatcher (CPU, gloo, 4 ranks)",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- command: `python -m benchmarks.bench_dispatcher_vs_megatron {' '.join(argv or sys.argv[1:])}`",
        f"- shape: {a.tokens} tokens per rank, H={a.hidden}, E={a.experts}, top-{a.topk}, fp32, dropless; "
        f"{a.iters} timed iterations after {a.warmup} warm-up, alternating Megatron-Core / folding / folding "
        f"per-expert / raw{' (and at EP4 the reference points)' if a.bounds else ''}, "
        "the order rotating every iteration",
        f"- machine: {cpus} usable CPUs, torch threads per rank {a.threads}; load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after",
        "- a time is forward + backward of dispatch, stand-in expert and combine, the slowest rank's; ratios "
        "are medians of per-iteration ratios; the CPU columns compare CPU time (user + system, all threads) "
        "summed over the ranks, which on a machine with fewer CPUs than ranks is what the wall time follows",
        "- allocation: see the script's docstring (freed memory kept = `MALLOC_MMAP_THRESHOLD_=32 MiB`, "
        f"`MALLOC_TRIM_THRESHOLD_=4 GiB` in the rank processes, and {a.prefault_mib} MiB of heap touched up front; "
        "glibc's defaults and nothing touched up front otherwise)",
        "",
    ] + tables
    with open(a.report, "w", encoding="utf-8") as f:
        f.write("\n".join(report))
    print(f"wrote {a.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
