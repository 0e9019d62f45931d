"""Benchmark the token dispatchers on N gloo ranks: bytes on the wire, host syncs, time vs a raw all-to-all.

Each rank routes ``--tokens`` random tokens (uniform random scores, top-k), dispatches them, applies an
identity expert (``out = x · p``, so that only token movement is timed) and combines. Reported:

- ``bytes_sent_per_rank``: hidden payload (scales included) this rank sends to *other* EP ranks in
  the dispatch and the combine all-to-alls (mean over ranks); ``bytes_floor_per_rank``: one row in the
  activation dtype per remote (token, expert) pair, each way; ``bytes_ratio`` = sent / floor.
- ``dedup_floor_per_rank``: one row per (token, remote EP rank) instead, each way (a DeepEP-style floor).
- ``etp_bytes_per_rank``: the ETP all-gather and reduce-scatter, separately.
- ``host_syncs_per_layer``: device-to-host reads per dispatch+combine (``folding.moe.dispatch.host_sync``).
- ``dispatch_combine_ms``: forward dispatch + combine (all six stages), median over iterations, max
  over ranks; ``a2a_only_ms``: two raw ``all_to_all_single`` calls moving exactly the bytes of the
  dispatcher's two EP all-to-alls (same splits), timed the same way; ``tokens_per_s``: global tokens
  per second through dispatch + combine.
- with a quantized wire: the output's error against the unquantized path and the bound it must meet
  (``wire_error``; see docs/dispatcher.md for the derivation).

Usage::

    python -m benchmarks.bench_dispatcher --ranks 8 --tokens 4096 --hidden 1024 --experts 8 --topk 2 --ep 8 \\
        --etp 1 --dispatcher alltoall --wire none --json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from folding.moe.dispatch import host_sync
from folding.moe.dispatch.build import build_dispatcher
from folding.moe.dispatch.wire import encode, payload_bytes_per_row
from folding.moe.routing.functions import expert_capacity
from folding.parallel import ParallelLayout, build_parallel_state
from folding.testing import RankPool

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
U_E4M3 = 2.0**-4  # unit round-off of e4m3 (3 mantissa bits, round to nearest)


def _route(T, E, k, seed, cf, pad):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    top = scores.topk(k, dim=1).indices
    rmap = torch.zeros(T, E, dtype=torch.bool).scatter_(1, top, True)
    if cf is not None:  # keep the earliest `capacity` tokens per expert (position policy)
        cap = expert_capacity(T, topk=k, num_experts=E, capacity_factor=cf)
        rmap = rmap & (rmap.cumsum(0) <= cap)
    probs = torch.where(rmap, torch.softmax(scores, dim=1), torch.zeros_like(scores))
    return rmap, probs


def _time(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def _worker(a):
    """One rank's share of the benchmark (module-level so RankPool can run it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(rank)
    ps = build_parallel_state(ParallelLayout(world_size=world, ep=a["ep"], etp=a["etp"], num_experts=a["experts"]))
    try:
        dt = DTYPES[a["dtype"]]
        T, H, E, k = a["tokens"], a["hidden"], a["experts"], a["topk"]
        cf, pad = a["capacity_factor"], a["pad_to_capacity"]
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(100 + rank)).to(dt)
        rmap, probs = _route(T, E, k, 1000 + rank, cf, pad)

        def make(wire):
            return build_dispatcher(
                a["dispatcher"],
                num_experts=E,
                topk=k,
                ep_group=ps.groups.ep,
                etp_group=ps.groups.etp,
                capacity_factor=cf,
                pad_to_capacity=pad,
                dispatch_wire=wire,
                combine_wire=wire,
                grad_wire="none",
            )

        d = make(a["wire"])

        def layer(expert=True):
            with torch.no_grad():
                tok, rec, p = d.dispatch(x, rmap, probs)
                # identity expert scaled by the probability (and 1/ETP: ETP partial sums add up)
                return d.combine(tok * (p / a["etp"]).unsqueeze(1).to(tok.dtype) if expert else tok, rec), rec

        before = host_sync.count()
        y, rec = layer()
        syncs = host_sync.count() - before
        stats = dict(rec.stats)
        ms = _time(lambda: layer(expert=False), a["warmup"], a["iters"])  # token movement only
        res = {"stats": stats, "syncs": syncs, "ms": ms}
        if a["dispatcher"] == "alltoall":
            # the same bytes through two raw all_to_all_single calls (rows and their probability)
            plan = rec.plan
            rowc = sum(q.shape[1] for q in encode(x[:1], a["wire"]))
            row = rowc + probs.element_size()
            s1 = torch.empty(plan.num_out_tokens, row, dtype=torch.uint8)
            r1 = torch.empty(sum(plan.output_splits), row, dtype=torch.uint8)
            s2 = torch.empty(sum(plan.output_splits), rowc, dtype=torch.uint8)
            r2 = torch.empty(plan.num_out_tokens, rowc, dtype=torch.uint8)

            def raw():
                dist.all_to_all_single(r1, s1, plan.output_splits, plan.input_splits, group=ps.groups.ep)
                dist.all_to_all_single(r2, s2, plan.input_splits, plan.output_splits, group=ps.groups.ep)

            res["a2a_ms"] = _time(raw, a["warmup"], a["iters"])
        # dedup floor: one row per (token, remote EP rank), each way
        L = E // a["ep"]
        dest = rmap.view(T, a["ep"], L).any(2)
        dest[:, ps.coords.ep.rank] = False
        res["dedup_rows"] = int(dest.sum())
        if a["wire"] != "none":
            ref = make("none")
            with torch.no_grad():
                tok, rec_ref, p = ref.dispatch(x, rmap, probs)
                y_ref = ref.combine(tok * (p / a["etp"]).unsqueeze(1).to(tok.dtype), rec_ref)
            # |err| <= (u(2+u) + 3 u_bf16)(1 + 2 u_bf16) * sum_k p_k |x| + subnormal slack (docs/dispatcher.md)
            u, ub = U_E4M3, 2.0**-8
            xf = x.float()
            psum = probs.sum(1, keepdim=True)
            bound = (u * (2 + u) + 3 * ub) * (1 + 2 * ub) * psum * xf.abs() + 2.0**-8 / 448 * xf.abs().amax(
                1, keepdim=True
            ) * psum
            err = (y.float() - y_ref.float()).abs()
            res["err"] = {
                "max_abs": float(err.max()),
                "violations": int((err > bound).sum()),
                "rel_fro": float(err.norm() / y_ref.float().norm()),
            }
        return res
    finally:
        ps.destroy()


def run(a) -> dict:
    """Run the benchmark described by the parsed arguments ``a`` (a dict) and return the JSON record."""
    with RankPool(a["ranks"]) as pool:
        res = pool.run(_worker, a, timeout_s=900)
    n = len(res)
    mean = lambda key: sum(r["stats"].get(key, 0) for r in res) / n  # noqa: E731
    sent = mean("ep_dispatch_bytes") + mean("ep_combine_bytes")
    floor = mean("ep_floor_bytes") if a["dispatcher"] == "alltoall" else sent
    elem = torch.empty((), dtype=DTYPES[a["dtype"]]).element_size()
    out = {
        "ranks": a["ranks"],
        "tokens": a["tokens"],
        "hidden": a["hidden"],
        "experts": a["experts"],
        "topk": a["topk"],
        "ep": a["ep"],
        "etp": a["etp"],
        "dispatcher": a["dispatcher"],
        "wire": a["wire"],
        "dtype": a["dtype"],
        "capacity_factor": a["capacity_factor"],
        "pad_to_capacity": a["pad_to_capacity"],
        "bytes_sent_per_rank": sent,
        "bytes_floor_per_rank": floor,
        "bytes_ratio": round(sent / floor, 4) if floor else None,
        "etp_bytes_per_rank": {
            "allgather": mean("etp_allgather_bytes"),
            "reduce_scatter": mean("etp_reduce_scatter_bytes"),
        },
        "dedup_floor_per_rank": 2 * sum(r["dedup_rows"] for r in res) / n * a["hidden"] * elem,
        "host_syncs_per_layer": max(r["syncs"] for r in res),
        "dispatch_combine_ms": max(r["ms"] for r in res),
        "a2a_only_ms": max(r["a2a_ms"] for r in res) if "a2a_ms" in res[0] else None,
        "payload_bytes_per_row": payload_bytes_per_row(a["wire"], a["hidden"], DTYPES[a["dtype"]]),
    }
    out["ratio_vs_a2a"] = round(out["dispatch_combine_ms"] / out["a2a_only_ms"], 3) if out["a2a_only_ms"] else None
    out["tokens_per_s"] = a["tokens"] * a["ranks"] / (out["dispatch_combine_ms"] / 1e3)
    if "err" in res[0]:
        out["wire_error"] = {
            "max_abs": max(r["err"]["max_abs"] for r in res),
            "bound_violations": sum(r["err"]["violations"] for r in res),
            "rel_fro": max(r["err"]["rel_fro"] for r in res),
        }
    return out


def _report(out, argv) -> str:
    rows = "\n".join(f"| {k} | {v} |" for k, v in out.items())
    return (
        f"# Dispatcher benchmark\n\n- date: {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC\n"
        f"- machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo\n"
        f"- command: `python -m benchmarks.bench_dispatcher {' '.join(argv)}`\n\n| field | value |\n|---|---|\n{rows}\n"
    )


def main(argv=None):
    """Parse flags, run, print a table (or one JSON line with ``--json``) and write the markdown report."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--ep", type=int, default=8)
    p.add_argument("--etp", type=int, default=1)
    p.add_argument("--dispatcher", choices=("alltoall", "allgather"), default="alltoall")
    p.add_argument("--wire", choices=("none", "fp8", "mxfp8"), default="none")
    p.add_argument("--capacity-factor", type=float, default=None)
    p.add_argument("--pad-to-capacity", action="store_true")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--report", default=None, help="markdown path (default benchmarks/dispatcher_<shape>.md)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    argv = sys.argv[1:] if argv is None else argv
    a = vars(p.parse_args(argv))
    if a["pad_to_capacity"] and a["capacity_factor"] is None:
        p.error("--pad-to-capacity needs --capacity-factor")
    out = run(a)
    path = a["report"] or (
        f"benchmarks/results/dispatcher_{a['dispatcher']}_r{a['ranks']}_t{a['tokens']}_h{a['hidden']}"
        f"_e{a['experts']}k{a['topk']}_ep{a['ep']}etp{a['etp']}_{a['wire']}"
        f"{'_pad' if a['pad_to_capacity'] else ''}.md"
    )
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(_report(out, argv))
    if a["json"]:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>24}: {v}")
        print(f"report: {path}")


if __name__ == "__main__":
    main()
