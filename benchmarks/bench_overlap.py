"""Overlap benchmark: how much MoE communication ``parallel.overlap_moe_comm`` hides, on CPU ranks.

gloo on a small CPU machine has no network worth hiding, so the link model
(:mod:`folding.testing.link_model`) times every collective as a GPU cluster's links would and makes
the host wait where NCCL's would: every EP token exchange lasts at least ``--link-latency-ms``; a
``Work.wait()`` returns at once and only makes the modelled stream wait; the host pays the stream's lag
at the dispatcher's count read and at the end of the step (which also waits for every collective in
flight); every collective (TP, router, gradient reductions, not only exchanges) takes its place in its
communicator's order (``--no-nccl-order`` drops the rule) and starts no earlier than the last of its
ranks issued it (``--no-peer-issue``: this rank). ``--link-rules exchange-wait`` runs the earlier model
(:mod:`folding.testing.link_model_v1`: an EP exchange's wait sleeps until its completion, other
collectives outside the model), the one the results before the NCCL-wait model were measured with.
Four gloo ranks (``folding.testing.RankPool``) train a small Mixtral-shaped MoE model in the chosen
layout for ``--steps`` optimizer steps, alternating overlap off and on step by step in one process
group (two models built alike from one seed, one per mode, each with its optimizer, since overlap is
set when a layer is built; the first ``--warmup`` steps of each mode are not counted). The JSON says
which rules were in force at its top level (``"link_rules"``, ``"rules"``, ``"nccl_order"``,
``"peer_issue"``, ``"own_communicators"``):

- ``step_time_off_s`` / ``step_time_on_s``: the step's wall time (rank 0), and their ratio;
- ``exposed_off_s`` / ``exposed_on_s``: the exposed communication (mean over the ranks): under
  ``nccl-wait`` the seconds the modelled stream stood idle waiting for collectives (their modelled
  completion, or the host blocked for real in gloo beyond the stream's backlog), under
  ``exchange-wait`` the time blocked in exchange waits; ``p2p_wait_off_s`` / ``p2p_wait_on_s``: the
  stream's idle time in pipeline receives (the schedule's bubbles and the sending stage's lag), apart;
  ``model_overhead_off_s`` / ``model_overhead_on_s``: the host's time in the link model's bookkeeping;
- ``hidden = 1 − exposed_on / exposed_off``: the share of the exposed communication that overlap hides;
- ``exposed_by_off_s`` / ``exposed_by_on_s``: the exposed time split by what was waited on (each
  exchange's name, ``ep counts`` for the dispatcher's count all-gathers, a collective's kind for the
  others, ``end of step`` for what was still in flight then); ``host_paid_by_off_s`` /
  ``host_paid_by_on_s``: where the host slept to catch up with the stream (``count read``, ``end of
  step``); ``blocked_off_s`` / ``blocked_on_s``: the real time blocked in exchange waits (gloo);
  ``load_before`` / ``load_after`` the host's load average around the run.

With ``--repeats N`` every layout runs N times and the JSON's ``summary`` gives, per layout, the
medians of ``hidden`` and of step on / off over the runs, each run's values and its load.
``--own-communicators`` / ``--no-own-communicators`` build the groups with
``build_parallel_state(own_communicators=...)``: a communicator per role that can be in flight from
both lanes (the default, as the trainer builds the groups with ``parallel.overlap_moe_comm``), or the
groups shared by rank list (what the rule costs when it is off).

Layouts (4 ranks): ``ep4`` (EP4, DP4, no pipelining: 16 micro-batches per step), ``ep2etp2`` (EP2 ×
ETP2), ``pp2ep2`` (PP2 with 1F1B, EP2). With ``--latencies`` it sweeps several latencies and writes a
Markdown report (``--out``) with the curve, the machine's load and the exact command.

Usage::

    python -m benchmarks.bench_overlap --layout ep4 --link-latency-ms 10 --steps 8 --json out.json
    python -m benchmarks.bench_overlap --layout pp2ep2 --repeats 6 --no-own-communicators --json out.json
    python -m benchmarks.bench_overlap --latencies 0,2,5,10,20 --layouts ep4,ep2etp2,pp2ep2 \\
        --out benchmarks/results/overlap_cpu.md
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from folding.data.config import DataConfig
from folding.job.config import JobConfig, LoggingConfig, ParallelConfig, TrainConfig, WandbConfig
from folding.model.chunks import build_stage_chunks
from folding.model.presets import get_preset
from folding.moe.settings import LayerSettings
from folding.optim.config import OptimConfig
from folding.optim.optimizer import FoldedOptimizer
from folding.overlap.runtime import OverlapRuntime
from folding.parallel import build_parallel_state
from folding.pipeline.stage import run_microbatches
from folding.testing import RankPool, link_model, link_model_v1
from folding.testing.overlap_audit import wait_stats

LINK_RULES = (link_model.RULES, "exchange-wait")
"""The link models a run may use: NCCL's waiting rules (the default) or the earlier model."""

LAYOUTS = {
    "ep4": dict(ep=4, etp=1),
    "ep2etp2": dict(ep=2, etp=2),
    "pp2ep2": dict(pp=2, ep=2, etp=1),
}


def _job(layout: str, a: dict):
    """The benchmark's training job on 4 ranks (a Mixtral-shaped model, fp32, synthetic tokens)."""

    model = get_preset(
        "mixtral_tiny",
        hidden_size=a["hidden"],
        num_layers=a["layers"],
        moe=dict(ffn_hidden_size=a["ffn"], num_experts=a["experts"], topk=2, aux_loss_coeff=0.0),
    )
    par = ParallelConfig(**LAYOUTS[layout])
    dp = 4 // (par.pp * par.tp * par.cp)
    return JobConfig(
        model=model,
        parallel=par,
        train=TrainConfig(
            steps=a["steps"],
            global_batch_size=a["microbatches"] * a["mbs"] * dp,
            micro_batch_size=a["mbs"],
            seq_length=a["seq"],
            eval_interval=0,
        ),
        optim=OptimConfig(lr=1e-4, warmup_steps=0, decay_style="constant"),
        data=DataConfig(),
        logging=LoggingConfig(console=False, wandb=WandbConfig(mode="disabled")),
    )


def _batch(job, M: int, gen: torch.Generator) -> List[Dict[str, torch.Tensor]]:
    """``M`` micro-batches of random tokens (every position counts in the loss)."""
    t, mbs = job.train, []
    for _ in range(M):
        tok = torch.randint(0, job.model.vocab_size, (t.micro_batch_size, t.seq_length + 1), generator=gen)
        mbs.append(dict(tokens=tok[:, :-1], labels=tok[:, 1:], loss_mask=torch.ones(tok[:, 1:].shape)))
    return mbs


def _rank_main(layout: str, a: dict) -> List[Dict[str, float]]:
    """One rank: build a model per mode (alike), then alternate overlap off / on per step; per-step records."""
    torch.set_num_threads(a["threads"])
    job = _job(layout, a)
    ps = build_parallel_state(job.layout(dist.get_world_size()), own_communicators=a["own_communicators"])
    runtime = OverlapRuntime()  # every step's (both modes): the link model and the wait statistics watch it
    records = []
    try:
        # --no-meta-comm: the dispatcher's counts on the EP communicator, behind its token payloads
        no_meta = dataclasses.replace(ps.groups, ep_meta=None)
        model_ps = ps if a["meta_comm"] else dataclasses.replace(ps, groups=no_meta)
        # one model per mode, both from the same seed (the overlap settings are construction settings)
        models, optimizers = {}, {}
        for on in (False, True):
            settings = LayerSettings(init_seed=1, overlap_comm=on, delay_wgrad=on and a["delay_wgrad"])
            models[on] = build_stage_chunks(model_config=job.model, parallel_state=model_ps, settings=settings)
            optimizers[on] = FoldedOptimizer(
                torch.nn.ModuleList(models[on]), job.optim, parallel_state=ps, train_steps=a["steps"]
            )
        t = job.train
        dp = ps.layout.dp
        M = t.global_batch_size // (t.micro_batch_size * dp)
        gen = torch.Generator().manual_seed(1000 + ps.coords.dp.rank)
        mbs = _batch(job, M, gen)
        run_microbatches(models[False], mbs, parallel_state=ps, loss_scale=1.0, forward_only=True)  # warm-up
        dist.barrier()
        t0 = time.perf_counter()
        run_microbatches(models[False], mbs, parallel_state=ps, loss_scale=1.0, forward_only=True)
        forward_s = time.perf_counter() - t0  # no link latency: the forward compute (and local exchanges)
        with _link(a, runtime) as links, wait_stats(runtime) as waits:
            for step in range(2 * a["steps"]):
                on = step % 2 == 1
                chunks, optimizer = models[on], optimizers[on]
                mbs = _batch(job, M, gen)
                dist.barrier()
                waits.reset()
                if links is not None:
                    links.reset()
                runtime.stats.reset()
                t0, c0 = time.perf_counter(), time.process_time()
                optimizer.zero_grad()
                run_microbatches(
                    chunks,
                    mbs,
                    parallel_state=ps,
                    loss_scale=1.0 / (M * dp * t.micro_batch_size * t.seq_length),
                    no_sync=optimizer.no_sync,
                    overlap=on,
                    runtime=runtime,
                )
                optimizer.clip_and_step()
                link_model.sync("end of step")  # the host waits for the stream (nothing outside the model)
                seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
                rec = dict(step=step // 2, overlap=on, step_time_s=seconds, cpu_s=cpu_s, forward_s=forward_s)
                rec.update(switch_s=runtime.stats.switch_s, hand_overs=runtime.stats.hand_overs)
                rec.update(blocked_s=waits.blocked_s, blocked_by=dict(waits.blocked_by), host_paid_by={})
                rec.update(estimated_peers=0, missing_peers=0, p2p_wait_s=0.0, model_overhead_s=0.0)
                if links is None:  # the earlier model: the exposed time is the time blocked in waits
                    rec.update(exposed_s=waits.blocked_s, exposed_by=dict(waits.blocked_by))
                else:
                    idle_by = links.idle_by  # a pipeline receive's wait is the schedule's, not a link's
                    p2p = idle_by.pop(link_model.P2P_WAIT, 0.0)
                    rec.update(exposed_s=links.idle_s - p2p, exposed_by=idle_by, p2p_wait_s=p2p)
                    rec.update(host_paid_by=dict(links.host_by), model_overhead_s=links.overhead_s)
                    rec.update(estimated_peers=links.estimated_peers, missing_peers=links.missing_peers)
                records.append(rec)
    finally:
        runtime.close()
        ps.destroy()
    return records


def _link(a: dict, runtime):
    """The link model of a run's settings, watching ``runtime``'s exchanges (``nccl-wait`` yields its
    :class:`~folding.testing.link_model.Links`, ``exchange-wait`` ``None``)."""
    seconds = a["latency_ms"] / 1e3
    if a["link_rules"] == link_model.RULES:
        return link_model.link_latency(runtime, seconds, nccl_order=a["nccl_order"], peer_issue=a["peer_issue"])

    @contextlib.contextmanager
    def earlier():
        with link_model_v1.link_latency(runtime, seconds, nccl_order=a["nccl_order"], peer_issue=a["peer_issue"]):
            yield None

    return earlier()


def run_layout(layout: str, a: dict, pool=None) -> dict:
    """Run one layout at one latency on 4 ranks; return the summary (medians after warm-up)."""

    own = pool is None
    pool = pool or RankPool(4)
    load_before = _load()
    try:
        per_rank = pool.run(_rank_main, layout, a, timeout_s=3600)
    finally:
        if own:
            pool.shutdown()
    load_after = _load()
    steps = []
    for i, rec in enumerate(per_rank[0]):
        exposed = statistics.fmean(r[i]["exposed_s"] for r in per_rank)
        blocked = statistics.fmean(r[i]["blocked_s"] for r in per_rank)
        p2p = statistics.fmean(r[i]["p2p_wait_s"] for r in per_rank)
        over = statistics.fmean(r[i]["model_overhead_s"] for r in per_rank)
        cpu = statistics.fmean(r[i]["cpu_s"] for r in per_rank)
        switch = statistics.fmean(r[i]["switch_s"] for r in per_rank)
        steps.append(
            dict(
                rec,
                exposed_s=exposed,
                blocked_s=blocked,
                p2p_wait_s=p2p,
                model_overhead_s=over,
                cpu_s=cpu,
                switch_s=switch,
            )
        )
        for key in ("exposed_by", "host_paid_by", "blocked_by"):
            whats = sorted({w for r in per_rank for w in r[i][key]})
            steps[-1][key] = {w: statistics.fmean(r[i][key].get(w, 0.0) for r in per_rank) for w in whats}
    kept = [s for s in steps if s["step"] >= a["warmup"]]

    def med(key, on):
        return statistics.median(s[key] for s in kept if s["overlap"] == on)

    def med_by(on, key="exposed_by"):
        whats = sorted({w for s in kept for w in s[key]})
        return {w: statistics.median(s[key].get(w, 0.0) for s in kept if s["overlap"] == on) for w in whats}

    out = dict(
        layout=layout,
        link_latency_ms=a["latency_ms"],
        link_rules=a["link_rules"],
        nccl_order=a["nccl_order"],
        peer_issue=a["peer_issue"],
        meta_comm=a["meta_comm"],
        own_communicators=a["own_communicators"],
        step_time_off_s=med("step_time_s", False),
        step_time_on_s=med("step_time_s", True),
        cpu_off_s=med("cpu_s", False),
        cpu_on_s=med("cpu_s", True),
        switch_on_s=med("switch_s", True),
        exposed_off_s=med("exposed_s", False),
        exposed_on_s=med("exposed_s", True),
        exposed_by_off_s=med_by(False),
        exposed_by_on_s=med_by(True),
        host_paid_by_off_s=med_by(False, "host_paid_by"),
        host_paid_by_on_s=med_by(True, "host_paid_by"),
        blocked_by_off_s=med_by(False, "blocked_by"),
        blocked_by_on_s=med_by(True, "blocked_by"),
        model_overhead_off_s=med("model_overhead_s", False),
        model_overhead_on_s=med("model_overhead_s", True),
        p2p_wait_off_s=med("p2p_wait_s", False),
        p2p_wait_on_s=med("p2p_wait_s", True),
        blocked_off_s=med("blocked_s", False),
        blocked_on_s=med("blocked_s", True),
        estimated_peers=sum(s["estimated_peers"] for s in steps),
        missing_peers=sum(s["missing_peers"] for s in steps),
        load_before=load_before,
        load_after=load_after,
        steps=steps,
    )
    out["step_time_ratio"] = out["step_time_on_s"] / out["step_time_off_s"]
    # compute of one transformer layer (attention + MoE) for one micro-batch: forward and backward (the
    # overlap-off step less its exposed communication, optimizer included), and forward alone (a
    # forward-only pass without link latency, rank 0)
    layers_per_step = a["microbatches"] * a["layers"] // LAYOUTS[layout].get("pp", 1)
    out["layer_compute_ms"] = 1e3 * (out["step_time_off_s"] - out["exposed_off_s"]) / layers_per_step
    out["layer_forward_ms"] = 1e3 * per_rank[0][0]["forward_s"] / layers_per_step
    out["hidden"] = 1 - out["exposed_on_s"] / out["exposed_off_s"] if out["exposed_off_s"] > 0 else None
    return out


def _load() -> tuple:
    """The host's load average (1, 5, 15 minutes), rounded."""
    return tuple(round(x, 2) for x in os.getloadavg())


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="ep4", help="the 4-rank layout")
    p.add_argument("--layouts", default=None, help="comma-separated layouts for a report (with --latencies)")
    p.add_argument("--link-latency-ms", type=float, default=10.0, help="link model: each EP exchange's latency")
    p.add_argument("--latencies", default=None, help="comma-separated latencies (ms) for a report")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per mode (alternating off/on)")
    p.add_argument("--warmup", type=int, default=2, help="steps per mode not counted")
    p.add_argument("--microbatches", type=int, default=16, help="micro-batches per step per data-parallel rank")
    p.add_argument("--mbs", type=int, default=1, help="micro-batch size (sequences)")
    p.add_argument("--seq", type=int, default=128, help="sequence length")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=256, help="expert FFN width")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument(
        "--delay-wgrad",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with overlap on, also parallel.delay_wgrad (expert weight gradients behind the backward dispatch)",
    )
    p.add_argument(
        "--nccl-order",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="link model: an operation on a process group completes after every one issued before it there",
    )
    p.add_argument(
        "--peer-issue",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="link model: an exchange completes its latency after the last of its ranks issued it",
    )
    p.add_argument(
        "--meta-comm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the dispatcher's token counts on their own communicator (ProcessGroups.ep_meta), not on EP's",
    )
    p.add_argument(
        "--link-rules",
        choices=LINK_RULES,
        default=link_model.RULES,
        help="the link model: NCCL's waits (nccl-wait) or the earlier exchange-wait model",
    )
    p.add_argument(
        "--own-communicators",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="build_parallel_state(own_communicators=...): a communicator per concurrent role (default: on, as "
        "the trainer builds them with overlap)",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs of every layout and latency (medians reported)")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--out", default=None, help="Markdown report (with --latencies)")
    return p.parse_args(argv)


def _settings(ns, latency_ms: float) -> dict:
    keys = (
        "steps",
        "warmup",
        "microbatches",
        "mbs",
        "seq",
        "hidden",
        "ffn",
        "experts",
        "layers",
        "threads",
        "delay_wgrad",
        "nccl_order",
        "peer_issue",
        "meta_comm",
        "link_rules",
        "own_communicators",
    )
    return dict({k: getattr(ns, k) for k in keys}, latency_ms=latency_ms)


def _report(results: List[dict], ns, command: str, load_before, load_after) -> str:
    lines = [
        "# Overlap of MoE communication on CPU ranks (link model)",
        "",
        f"Measured {datetime.date.today().isoformat()} on {platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}; load average before {load_before}, after {load_after}.",
        "",
        f"Command: `{command}`",
        "",
        f"Model: Mixtral-shaped, hidden {ns.hidden}, {ns.experts} experts of FFN {ns.ffn}, top-2, {ns.layers} "
        f"layers, sequence {ns.seq}, micro-batch {ns.mbs}, {ns.microbatches} micro-batches per step and data-parallel "
        f"rank, fp32, {ns.threads} thread(s) per rank, 4 gloo ranks. Overlap off and on "
        f"({'with' if ns.delay_wgrad else 'without'} parallel.delay_wgrad) alternate step by step "
        f"(medians of {ns.steps - ns.warmup} steps each after {ns.warmup} warm-up steps). Link model: "
        f"`{ns.link_rules}` (NCCL's order {'on' if ns.nccl_order else 'off'}, last sender "
        f"{'on' if ns.peer_issue else 'off'}); own_communicators: {ns.own_communicators}.",
        "",
        "| layout | link latency (ms) | layer forward (ms) | layer fwd+bwd (ms) | step off (s) | step on (s) "
        "| on / off | exposed off (s) | exposed on (s) | hidden |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        hidden = "n/a" if r["hidden"] is None else f"{r['hidden']:.2f}"
        lines.append(
            f"| {r['layout']} | {r['link_latency_ms']:g} | {r['layer_forward_ms']:.1f} | {r['layer_compute_ms']:.1f} "
            f"| {r['step_time_off_s']:.3f} "
            f"| {r['step_time_on_s']:.3f} "
            f"| {r['step_time_ratio']:.2f} | {r['exposed_off_s']:.3f} | {r['exposed_on_s']:.3f} | {hidden} |"
        )
    return "\n".join(lines + _breakdown(results)) + "\n"


def _breakdown(results: List[dict]) -> List[str]:
    """Per run, where the exposed time went (off → on, seconds per step): by what the stream waited for,
    where the host paid, the pipeline receives' waits and the model's own bookkeeping."""
    lines = ["", "Where the time went, per step (off → on):", ""]
    for r in results:
        by = {w: (r["exposed_by_off_s"].get(w, 0.0), r["exposed_by_on_s"].get(w, 0.0)) for w in r["exposed_by_off_s"]}
        by.update({w: (0.0, v) for w, v in r["exposed_by_on_s"].items() if w not in by})
        paid = {
            w: (r["host_paid_by_off_s"].get(w, 0.0), r["host_paid_by_on_s"].get(w, 0.0))
            for w in r["host_paid_by_off_s"]
        }
        cells = ", ".join(f"{w} {a:.3f} → {b:.3f}" for w, (a, b) in sorted(by.items()))
        host = ", ".join(f"{w} {a:.3f} → {b:.3f}" for w, (a, b) in sorted(paid.items())) or "none"
        lines.append(
            f"- {r['layout']} (run {r.get('repeat', 0) + 1}): exposed by {cells}; host paid at {host}; "
            f"pipeline receives {r['p2p_wait_off_s']:.3f} → {r['p2p_wait_on_s']:.3f}; real gloo waits "
            f"{r['blocked_off_s']:.3f} → {r['blocked_on_s']:.3f}; model bookkeeping "
            f"{r['model_overhead_off_s']:.3f} → {r['model_overhead_on_s']:.3f}; "
            f"load {r['load_before']} → {r['load_after']}."
        )
    return lines


def main(argv=None) -> None:
    """Command-line entry point (see the module docstring)."""

    ns = _args(argv)
    command = "python -m benchmarks.bench_overlap " + " ".join(sys.argv[1:] if argv is None else argv)
    layouts = ns.layouts.split(",") if ns.layouts else [ns.layout]
    latencies = [float(x) for x in ns.latencies.split(",")] if ns.latencies else [ns.link_latency_ms]
    for name in layouts:
        if name not in LAYOUTS:
            raise SystemExit(f"error: --layouts: unknown layout {name!r}; choose from {sorted(LAYOUTS)}")
    if ns.repeats < 1:
        raise SystemExit("error: --repeats must be >= 1")
    load_before = _load()
    results = []
    pool = RankPool(4)
    try:
        for name in layouts:
            for lat in latencies:
                for rep in range(ns.repeats):
                    r = run_layout(name, _settings(ns, lat), pool)
                    r["repeat"] = rep
                    results.append(r)
                    _print_run(r)
    finally:
        pool.shutdown()
    load_after = _load()
    summary = summarize(results)
    for row in summary:
        h = "n/a" if row["hidden_median"] is None else f"{row['hidden_median']:.3f}"
        print(
            f"{row['layout']} latency {row['link_latency_ms']:g} ms, medians of {row['repeats']} runs: "
            f"hidden {h}, step on/off x{row['ratio_median']:.3f} (load {load_before} -> {load_after})",
            flush=True,
        )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(_json(results, summary, ns, command, load_before, load_after), f, indent=1)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(_report(results, ns, command, load_before, load_after))


def _print_run(r: dict) -> None:
    # three decimals: the targets are hundredths (hidden >= 0.65, step <= 0.80x), and 0.647 is not 0.65
    hidden = "n/a" if r["hidden"] is None else f"{r['hidden']:.3f}"
    print(
        f"{r['layout']} latency {r['link_latency_ms']:g} ms [{r['link_rules']}]: "
        f"step off {r['step_time_off_s']:.3f} s, "
        f"on {r['step_time_on_s']:.3f} s (x{r['step_time_ratio']:.3f}); exposed off {r['exposed_off_s']:.3f} s, "
        f"on {r['exposed_on_s']:.3f} s; hidden {hidden}; load {r['load_before']} -> {r['load_after']}",
        flush=True,
    )


def summarize(results: List[dict]) -> List[dict]:
    """Per layout and latency: the medians of hidden and of step on / off over its runs, with each run's
    values and its host load (1, 5, 15 min before and after)."""
    rows = []
    for key in dict.fromkeys((r["layout"], r["link_latency_ms"]) for r in results):
        mine = [r for r in results if (r["layout"], r["link_latency_ms"]) == key]
        hid = [r["hidden"] for r in mine if r["hidden"] is not None]
        rat = [r["step_time_ratio"] for r in mine]
        rows.append(
            dict(
                layout=key[0],
                link_latency_ms=key[1],
                repeats=len(mine),
                hidden_median=statistics.median(hid) if hid else None,
                ratio_median=statistics.median(rat),
                hidden_runs=[r["hidden"] for r in mine],
                ratio_runs=rat,
                loads=[[r["load_before"], r["load_after"]] for r in mine],
            )
        )
    return rows


def _json(results, summary, ns, command, load_before, load_after) -> dict:
    """The JSON report: the single run's numbers at the top (one run), the rules in force, the medians."""
    top = results[0] if len(results) == 1 else {}
    keys = ("hidden", "step_time_on_s", "step_time_off_s", "exposed_on_s", "exposed_off_s", "step_time_ratio")
    keys += ("layer_compute_ms", "layer_forward_ms", "layout", "link_latency_ms")
    out = {k: top[k] for k in keys} if top else {}
    out.update(link_rules=ns.link_rules, nccl_order=ns.nccl_order, peer_issue=ns.peer_issue, meta_comm=ns.meta_comm)
    out.update(own_communicators=ns.own_communicators)
    if ns.link_rules == link_model.RULES:
        m = link_model.LinkModel(latency_s=ns.link_latency_ms / 1e3, nccl_order=ns.nccl_order, peer_issue=ns.peer_issue)
        out["rules"] = link_model.rules(m)
    out.update(summary=summary, runs=results, command=command, load_before=load_before, load_after=load_after)
    return out


if __name__ == "__main__":
    main()
