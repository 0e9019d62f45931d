"""Node-aware dispatch on CPU ranks: ``alltoall`` against ``hierarchical`` across modelled nodes.

One machine is made ``--nodes`` nodes of ``--nvlink-domain`` gloo ranks each (``parallel.nvlink_domain``;
``folding.testing.RankPool`` with N·G ranks, EP over all of them, ETP1). Every rank routes ``--tokens``
random tokens to ``--topk`` of ``--experts`` experts (uniform random scores; with ``--node-limited M``
first the M best nodes by their experts' top-2 score sum, as DeepSeek-V3's group-limited routing with one
group per node) and runs one MoE layer's forward and backward: dispatch, a SwiGLU-like expert
``(silu(x·A)·p)·B`` per local expert, combine, and the backward of all of it. The two dispatchers run the
same routing, alternating step by step in one process group.

gloo on one machine has no slow link, so the link model (:func:`folding.testing.link_model.link_model`)
times every collective by its bytes over each link class's bandwidth, inter-node (global rank // G
differs) and intra-node, shared by the transfers in flight on it, each EP exchange paying its latency
once; a ``Work.wait()`` returns at once (NCCL's) and the host pays the stream's lag at the count read and
at the end of the step (``link_rules`` ``nccl-wait``; ``--link-rules exchange-wait``: the earlier model,
whose waits sleep until each EP exchange's completion and which times no other collective). The
NIC : NVLink ratio is an H100 node's, 50 : 450 GB/s (1 : 9); by default both are scaled so that one
``alltoall`` exchange's inter-node bytes take about one layer's compute (forward + backward) on this
machine, measured first under an unlimited link (``--nic-mbps`` / ``--nvlink-mbps`` set them).

Reported (JSON top level): ``inter_node_bytes_alltoall``, ``inter_node_bytes_hierarchical``,
``intra_node_bytes_alltoall``, ``intra_node_bytes_hierarchical`` (bytes handed to the EP exchanges per step,
summed over all ranks, counted by the link model from the all-to-alls' split sizes: hidden rows, their
probabilities and the hierarchical dispatcher's routing metadata) and ``step_time_alltoall_s``,
``step_time_hierarchical_s`` (median wall time of a step, the slowest rank's, after warm-up), with the
link settings (``link_rules`` and ``rules``: the link model's rules; ``nccl_order``: it keeps NCCL's
per-communicator order), the host's load
(``os.getloadavg`` before and after) and the device. ``--report`` runs the
sweep of the committed report (2 and 4 nodes, top-2 and top-8, node-limited off and on) and writes
Markdown (``--out``) and JSON (``--json``).

Usage::

    python -m benchmarks.bench_node_dispatch --nodes 2 --nvlink-domain 4 --experts 32 --topk 8 --json out.json
    python -m benchmarks.bench_node_dispatch --report --out benchmarks/results/node_dispatch_cpu.md \\
        --json benchmarks/results/node_dispatch_cpu.json
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
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from folding.moe.dispatch.build import build_dispatcher
from folding.overlap.runtime import OverlapRuntime
from folding.parallel import ParallelLayout, build_parallel_state
from folding.testing import RankPool, link_model_v1
from folding.testing import link_model as lm

NIC_TO_NVLINK = 9.0
"""An H100 node's NVLink bandwidth over its NIC's per GPU: 450 / 50 GB/s per direction."""
KINDS = ("alltoall", "hierarchical")


def route(T: int, E: int, k: int, nodes: int, limit: Optional[int], gen: torch.Generator):
    """``(routing_map_TE, probs_TE)`` of ``T`` tokens: top-``k`` of uniform random scores (softmax
    probabilities of the chosen), restricted with ``limit`` to the ``limit`` nodes (contiguous blocks of
    ``E/nodes`` experts) whose experts' two best scores sum highest."""
    scores = torch.rand(T, E, generator=gen)
    masked = scores
    if limit is not None and limit < nodes:
        per_node_TNe = scores.view(T, nodes, E // nodes)
        node_score_TN = per_node_TNe.topk(min(2, E // nodes), dim=2).values.sum(2)
        keep_TN = torch.zeros(T, nodes, dtype=torch.bool).scatter_(1, node_score_TN.topk(limit, dim=1).indices, True)
        masked = scores.masked_fill(~keep_TN.repeat_interleave(E // nodes, dim=1), float("-inf"))
    top = masked.topk(k, dim=1).indices
    rmap = torch.zeros(T, E, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.where(rmap, torch.softmax(scores, dim=1), torch.zeros_like(scores))
    return rmap, probs


def _experts(tokens_NH, tpe, probs_N, A_LHF, B_LFH):
    outs, start = [], 0
    for i, n in enumerate(tpe.tolist()):
        xs, ps = tokens_NH[start : start + n], probs_N[start : start + n]
        outs.append((F.silu(xs @ A_LHF[i]) * ps.unsqueeze(1)) @ B_LFH[i])
        start += n
    return torch.cat(outs) if outs else tokens_NH[:0]


def _layer_step(d, x, rmap, probs, A, B) -> None:
    """One MoE layer's forward and backward through dispatcher ``d``."""
    xl = x.clone().requires_grad_(True)
    pl = probs.clone().requires_grad_(True)
    tokens, rec, pn = d.dispatch(xl, rmap, pl)
    y = d.combine(_experts(tokens, rec.tokens_per_expert, pn, A, B), rec)
    y.square().mean().backward()


def _steps(ds, a, gen_seed: int, n: int, model: dict) -> List[Dict[str, float]]:
    """``n`` rounds, each one step per dispatcher on the same routing, under the link ``model``; per step
    the wall time and this rank's bytes per link class."""
    rank = dist.get_rank()
    H, T, E, k = a["hidden"], a["tokens"], a["experts"], a["topk"]
    L = E // dist.get_world_size()
    g = torch.Generator().manual_seed(1234 + rank)
    A = (torch.randn(L, H, a["ffn"], generator=g) / H**0.5).requires_grad_(True)
    B = (torch.randn(L, a["ffn"], H, generator=g) / a["ffn"] ** 0.5).requires_grad_(True)
    out = []
    new = a["link_rules"] == lm.RULES
    counters = lm.traffic if new else link_model_v1.traffic
    runtime = OverlapRuntime()  # the dispatchers' exchanges bind to it; the link model watches it
    with runtime, runtime.active(), (lm.link_model if new else link_model_v1.link_model)(runtime, **model):
        for i in range(n):
            gen = torch.Generator().manual_seed(gen_seed + 7919 * i + rank)
            x = torch.randn(T, H, generator=gen)
            rmap, probs = route(T, E, k, a["nodes"], a["node_limited"], gen)
            for kind in KINDS:
                dist.barrier()
                counters.reset()
                t0 = time.perf_counter()
                _layer_step(ds[kind], x, rmap, probs, A, B)
                lm.sync("end of step")  # the host waits for the stream (nothing outside the new model)
                took = time.perf_counter() - t0
                out.append(
                    dict(
                        round=i,
                        kind=kind,
                        seconds=took,
                        inter=counters.inter_node_bytes,
                        intra=counters.intra_node_bytes,
                    )
                )
    return out


def _worker(a: dict):
    """One rank: calibrate the links under an unlimited model, then measure both dispatchers alternating."""
    torch.set_num_threads(1)
    world, G = dist.get_world_size(), a["nvlink_domain"]
    ps = build_parallel_state(
        ParallelLayout(world_size=world, ep=world, etp=1, num_experts=a["experts"], nvlink_domain=G)
    )
    try:
        common = dict(num_experts=a["experts"], topk=a["topk"], ep_group=ps.groups.ep, etp_group=ps.groups.etp)
        ds = {
            "alltoall": build_dispatcher("alltoall", **common),
            "hierarchical": build_dispatcher(
                "hierarchical", node_group=ps.groups.ep_node, rail_group=ps.groups.ep_rail, nvlink_domain=G, **common
            ),
        }
        assert type(ds["hierarchical"]).__name__ == "HierarchicalDispatcher", "EP must span nodes"
        unlimited = dict(inter_node_bandwidth=1e18, intra_node_bandwidth=1e18, nvlink_domain=G)
        calib = _steps(ds, a, 1, a["calib_steps"], unlimited)
        nic, nvl = a["nic_mbps"], a["nvlink_mbps"]
        if nic is None:
            # one alltoall exchange's inter-node bytes (a rank's, the ranks' mean; 4 EP exchanges per step)
            # over one layer's compute (the alltoall step under the unlimited link, slowest rank's median)
            mine = [r for r in calib if r["kind"] == "alltoall"]
            v = torch.tensor(
                [statistics.median(r["inter"] for r in mine), statistics.median(r["seconds"] for r in mine)],
                dtype=torch.float64,
            )
            t = v.clone()
            dist.all_reduce(v)  # sum of bytes
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            per_exchange = float(v[0]) / world / 4
            layer_s = float(t[1])
            nic = per_exchange / layer_s / 1e6
        nvl = nvl if nvl is not None else NIC_TO_NVLINK * nic
        model = dict(
            latency_s=a["latency_ms"] / 1e3,
            inter_node_bandwidth=nic * 1e6,
            intra_node_bandwidth=nvl * 1e6,
            nvlink_domain=G,
            nccl_order=NCCL_ORDER,
        )
        records = _steps(ds, a, 100, a["warmup"] + a["steps"], model)
    finally:
        ps.destroy()
    return dict(records=records, calib=calib, nic_mbps=nic, nvlink_mbps=nvl)


def run(a: dict, pool=None) -> dict:
    """Run one configuration on ``nodes · nvlink_domain`` ranks; the summary record (see the module
    docstring)."""
    world = a["nodes"] * a["nvlink_domain"]
    if a["experts"] % world:
        raise SystemExit(f"error: --experts {a['experts']} must be a multiple of the {world} ranks (EP = all ranks)")
    load_before = tuple(round(x, 2) for x in os.getloadavg())
    own = pool is None
    pool = pool or RankPool(world)
    try:
        per_rank = pool.run(_worker, a, timeout_s=3600)
    finally:
        if own:
            pool.shutdown()
    load_after = tuple(round(x, 2) for x in os.getloadavg())
    rules = None
    if a["link_rules"] == lm.RULES:
        model = lm.LinkModel(
            latency_s=a["latency_ms"] / 1e3,
            inter_node_bandwidth=per_rank[0]["nic_mbps"] * 1e6,
            intra_node_bandwidth=per_rank[0]["nvlink_mbps"] * 1e6,
            nvlink_domain=a["nvlink_domain"],
            nccl_order=NCCL_ORDER,
        )
        rules = lm.rules(model)
    out = dict(
        nodes=a["nodes"],
        nvlink_domain=a["nvlink_domain"],
        experts=a["experts"],
        topk=a["topk"],
        hidden=a["hidden"],
        ffn=a["ffn"],
        tokens=a["tokens"],
        node_limited=a["node_limited"],
        latency_ms=a["latency_ms"],
        link_rules=a["link_rules"],
        nccl_order=NCCL_ORDER,
        rules=rules,
        nic_mbps=per_rank[0]["nic_mbps"],
        nvlink_mbps=per_rank[0]["nvlink_mbps"],
        load_before=load_before,
        load_after=load_after,
        device=f"cpu ({platform.machine()}, {os.cpu_count()} CPUs, gloo, {world} ranks), torch {torch.__version__}",
    )
    n = len(per_rank[0]["records"])
    steps = []
    for i in range(n):
        recs = [r["records"][i] for r in per_rank]
        steps.append(
            dict(
                round=recs[0]["round"],
                kind=recs[0]["kind"],
                seconds=max(r["seconds"] for r in recs),
                inter=sum(r["inter"] for r in recs),
                intra=sum(r["intra"] for r in recs),
            )
        )
    kept = [s for s in steps if s["round"] >= a["warmup"]]
    calib = [max(r["calib"][i]["seconds"] for r in per_rank) for i in range(len(per_rank[0]["calib"]))]
    out["layer_compute_unlimited_link_s"] = statistics.median(calib[0::2])  # the alltoall steps
    out["layer_compute_unlimited_link_hierarchical_s"] = statistics.median(calib[1::2])
    for kind in KINDS:
        mine = [s for s in kept if s["kind"] == kind]
        out[f"inter_node_bytes_{kind}"] = statistics.median(s["inter"] for s in mine)
        out[f"intra_node_bytes_{kind}"] = statistics.median(s["intra"] for s in mine)
        out[f"step_time_{kind}_s"] = statistics.median(s["seconds"] for s in mine)
    out["inter_node_bytes_ratio"] = out["inter_node_bytes_alltoall"] / max(out["inter_node_bytes_hierarchical"], 1)
    out["step_time_ratio"] = out["step_time_hierarchical_s"] / out["step_time_alltoall_s"]
    _predict(out, world)
    out["steps"] = steps
    return out


def _predict(out: dict, world: int) -> None:
    """The step times the link model predicts from the counted bytes: each dispatcher's step under the
    unlimited link plus its four EP exchanges (forward dispatch and combine, their backward), each moving a
    quarter of the step's bytes per rank (the ranks' mean); ``alltoall``'s classes at the same time (one
    exchange), ``hierarchical``'s stage A (inter-node) then stage B (intra-node)."""
    nic, nvl = out["nic_mbps"] * 1e6, out["nvlink_mbps"] * 1e6
    per = {k: (out[f"inter_node_bytes_{k}"] / world / 4, out[f"intra_node_bytes_{k}"] / world / 4) for k in KINDS}
    lat = out["latency_ms"] / 1e3
    a2a = lat + max(per["alltoall"][0] / nic, per["alltoall"][1] / nvl)
    hier = 2 * lat + per["hierarchical"][0] / nic + per["hierarchical"][1] / nvl
    out["predicted_step_time_alltoall_s"] = out["layer_compute_unlimited_link_s"] + 4 * a2a
    out["predicted_step_time_hierarchical_s"] = out["layer_compute_unlimited_link_hierarchical_s"] + 4 * hier


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, help="modelled nodes N")
    p.add_argument("--nvlink-domain", type=int, default=4, help="ranks per node G (parallel.nvlink_domain)")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=256, help="expert FFN width")
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    p.add_argument("--node-limited", type=int, default=None, metavar="M", help="route each token to at most M nodes")
    p.add_argument("--latency-ms", type=float, default=0.0, help="link model: latency of every EP exchange")
    p.add_argument("--nic-mbps", type=float, default=None, help="inter-node MB/s per rank (default: calibrated)")
    p.add_argument("--nvlink-mbps", type=float, default=None, help=f"intra-node MB/s (default {NIC_TO_NVLINK:g}x NIC)")
    p.add_argument("--steps", type=int, default=5, help="measured steps per dispatcher")
    p.add_argument("--warmup", type=int, default=2, help="steps per dispatcher not counted")
    p.add_argument("--calib-steps", type=int, default=3, help="steps per dispatcher under an unlimited link")
    p.add_argument(
        "--link-rules",
        choices=(lm.RULES, "exchange-wait"),
        default=lm.RULES,
        help="the link model: NCCL's waits (nccl-wait) or the earlier exchange-wait model",
    )
    p.add_argument("--report", action="store_true", help="run the committed report's sweep")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--out", default=None, help="Markdown report (with --report)")
    return p.parse_args(argv)


def _settings(ns, **over) -> dict:
    keys = ("nodes", "nvlink_domain", "experts", "topk", "hidden", "ffn", "tokens", "node_limited", "latency_ms")
    keys += ("nic_mbps", "nvlink_mbps", "steps", "warmup", "calib_steps", "link_rules")
    d = {k: getattr(ns, k) for k in keys}
    d.update(over)
    return d


NCCL_ORDER = True
"""The link model keeps NCCL's rule (an operation on a process group completes after every one issued
before it there); reported at the JSON's top level."""


REPORT_CASES = [
    dict(nodes=2, nvlink_domain=4, topk=8, node_limited=None),
    dict(nodes=2, nvlink_domain=4, topk=8, node_limited=1),
    dict(nodes=2, nvlink_domain=4, topk=2, node_limited=None),
    dict(nodes=4, nvlink_domain=2, topk=8, node_limited=None),
    dict(nodes=4, nvlink_domain=2, topk=8, node_limited=2),
    dict(nodes=4, nvlink_domain=2, topk=2, node_limited=None),
]
"""The committed report's sweep (8 ranks each; 32 experts)."""


def _line(r: dict) -> str:
    lim = "off" if r["node_limited"] is None else f"{r['node_limited']}"
    return (
        f"| {r['nodes']} × {r['nvlink_domain']} | {r['topk']} | {lim} | {r['nic_mbps']:.1f} / {r['nvlink_mbps']:.1f} "
        f"| {r['inter_node_bytes_alltoall'] / 1e6:.2f} | {r['inter_node_bytes_hierarchical'] / 1e6:.2f} "
        f"| {r['inter_node_bytes_ratio']:.2f} | {r['intra_node_bytes_alltoall'] / 1e6:.2f} "
        f"| {r['intra_node_bytes_hierarchical'] / 1e6:.2f} | {r['layer_compute_unlimited_link_s'] * 1e3:.0f} "
        f"| {r['step_time_alltoall_s'] * 1e3:.0f} | {r['step_time_hierarchical_s'] * 1e3:.0f} "
        f"| {r['step_time_ratio']:.2f} | {r['predicted_step_time_alltoall_s'] * 1e3:.0f} / "
        f"{r['predicted_step_time_hierarchical_s'] * 1e3:.0f} | {r['load_before'][0]:.1f} → {r['load_after'][0]:.1f} |"
    )


def _report(results: List[dict], ns, command: str) -> str:
    r0 = results[0]
    lines = [
        "# Node-aware dispatch on CPU ranks (two-class link model)",
        "",
        f"Measured {datetime.date.today().isoformat()} on {r0['device']}.",
        "",
        f"Command: `{command}`",
        "",
        f"One MoE layer, forward + backward: {ns.experts} experts (SwiGLU-like, FFN {ns.ffn}), hidden {ns.hidden}, "
        f"{ns.tokens} tokens per rank, fp32, EP over all 8 ranks (ETP1), one thread per rank; `alltoall` and "
        f"`hierarchical` alternate step by step on the same routing (medians of {ns.steps} steps each after "
        f"{ns.warmup} warm-up steps). Links: NIC : NVLink = 1 : 9 (an H100 node's), scaled so that one "
        f"`alltoall` exchange's inter-node bytes take one layer's compute (measured first under an unlimited "
        f"link); latency {ns.latency_ms:g} ms. Bytes: per step, all ranks, what the EP all-to-alls carry (rows, "
        "probabilities, routing metadata). Predicted: each dispatcher's step under the unlimited link plus four "
        "exchanges of a quarter of its counted bytes per rank at the link model's rates (alltoall's classes at "
        "once, hierarchical's two stages one after the other). Layer compute: the alltoall step under the "
        "unlimited link. Load: the host's 1-minute load average before → after (2 cores, shared).",
        "",
        "| nodes × ranks | top-k | node-limited | NIC / NVLink (MB/s) | inter-node MB alltoall | hierarchical "
        "| fewer | intra-node MB alltoall | hierarchical | layer compute (ms) | step alltoall (ms) "
        "| hierarchical (ms) | hier / a2a | predicted a2a / hier (ms) | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_line(r) for r in results]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    """Command-line entry point (see the module docstring)."""
    ns = _args(argv)
    command = "python -m benchmarks.bench_node_dispatch " + " ".join(sys.argv[1:] if argv is None else argv)
    cases = REPORT_CASES if ns.report else [{}]
    results = []
    for over in cases:
        r = run(_settings(ns, **over))
        results.append(r)
        print(
            f"{r['nodes']}x{r['nvlink_domain']} top-{r['topk']} node-limited {r['node_limited']}: inter-node bytes "
            f"alltoall {r['inter_node_bytes_alltoall']:.0f}, hierarchical {r['inter_node_bytes_hierarchical']:.0f} "
            f"({r['inter_node_bytes_ratio']:.2f}x fewer); intra-node {r['intra_node_bytes_alltoall']:.0f} vs "
            f"{r['intra_node_bytes_hierarchical']:.0f}; step alltoall {r['step_time_alltoall_s']:.3f} s, "
            f"hierarchical {r['step_time_hierarchical_s']:.3f} s (x{r['step_time_ratio']:.2f}); links "
            f"{r['nic_mbps']:.1f}/{r['nvlink_mbps']:.1f} MB/s; load {r['load_before']} -> {r['load_after']}",
            flush=True,
        )
    if ns.json:
        summary = dict(results[0])  # the report's first case is the 2 x 4, top-8 target
        summary.update(command=command)
        if len(results) > 1:
            summary.update(runs=results)
        with open(ns.json, "w") as f:
            json.dump(summary, f, indent=1)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(_report(results, ns, command))


if __name__ == "__main__":
    main()
