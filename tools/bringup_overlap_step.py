"""The bring-up's overlap step (``python -m tools.bringup_device_cases overlap-step``): one process per GPU.

Each rank builds a small Mixtral-shaped model with EP over every rank (``mixtral_tiny`` widened), then
runs training steps with ``parallel.overlap_moe_comm`` on (and ``parallel.delay_wgrad``):

1. a warm-up step (first-use probes, the caching allocator);
2. a step under ``torch.cuda.set_sync_debug_mode("warn")``: every synchronization CUDA reports,
   counted by its call site in the engine (:func:`sync_sites`);
3. a step with overlap off and one with it on, each exchange's wait bracketed by CUDA events on the
   compute stream (:func:`exchange_events`): the device time the stream
   stood waiting for each exchange, by exchange name, off and on;
4. the overlapped step timed whole by events on the compute stream, with the groups built as the
   trainer builds them under overlap (``own_communicators=True``: a communicator per concurrent role)
   and again with the groups shared by rank list (``own_communicators=False``): what the rule is worth
   (``step_ms``, with the exposed time of the shared build in ``exposed_on_shared``).

The groups of steps 1–3 are the trainer's (a communicator per concurrent role).

With one GPU the EP group has one rank and there is no exchange to time (reported so). ``cpu=True``
runs the same steps on gloo CPU ranks (the script's smoke test): no sync debug mode there, and the
events are host clocks (gloo's wait blocks the host, so the host time is the exposed time).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from folding.model.chunks import build_stage_chunks
from folding.model.presets import get_preset
from folding.moe.settings import LayerSettings
from folding.optim.config import OptimConfig
from folding.optim.optimizer import FoldedOptimizer
from folding.overlap.exchange import ExchangeObserver
from folding.overlap.runtime import OverlapRuntime
from folding.parallel import ParallelLayout, build_parallel_state
from folding.parallel.groups import release_process_groups
from folding.pipeline.stage import run_microbatches

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
NO_CUDA = "no CUDA device visible (a GPU-only case)"

SIZES = {"gpu": dict(hidden=1024, ffn=1024, seq=1024), "cpu": dict(hidden=128, ffn=128, seq=64)}
"""Hidden size, expert FFN width and sequence length of the GPU run and of the CPU smoke run."""
EXPERTS, LAYERS, MICROBATCHES = 8, 2, 8
"""Experts (top-2), layers and micro-batches per step of both."""


@contextlib.contextmanager
def captured_warnings() -> Any:
    """Record every warning raised inside the block with the Python stack that raised it: a list of
    ``(message, [FrameSummary, ...])`` (innermost last)."""
    records: List[tuple] = []
    old = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        records.append((str(message), traceback.extract_stack()[:-1]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        try:
            yield records
        finally:
            warnings.showwarning = old


def call_site(stack, root: str = ROOT) -> str:
    """The engine line a warning came from: the innermost frame under ``root/folding``, else the
    innermost under ``root`` outside this module, as ``path:line (function)``; ``"?"`` if none."""
    here = os.path.abspath(__file__)
    inside = [f for f in stack if os.path.abspath(f.filename).startswith(root + os.sep)]
    inside = [f for f in inside if os.path.abspath(f.filename) != here]
    engine = [f for f in inside if os.path.relpath(os.path.abspath(f.filename), root).startswith("folding" + os.sep)]
    pick = (engine or inside or [None])[-1]
    if pick is None:
        return "?"
    return f"{os.path.relpath(os.path.abspath(pick.filename), root)}:{pick.lineno} ({pick.name})"


def sync_sites(records, root: str = ROOT) -> Dict[str, int]:
    """Count the synchronization warnings of :func:`captured_warnings` by :func:`call_site`."""
    by = collections.Counter()
    for message, stack in records:
        if "synchroniz" in message.lower():
            by[call_site(stack, root)] += 1
    return dict(by.most_common())


# --------------------------------------------------------------------- exchanges by CUDA events


class _TimedWork:
    """A collective's work whose wait is bracketed by events on the current stream (see below)."""

    def __init__(self, work, before=None, after=None):
        self.work, self.before, self.after = work, before, after

    def wait(self):
        if self.before is not None:
            self.before.record()
        out = self.work.wait()
        if self.after is not None:
            self.after.record()
        return out


@contextlib.contextmanager
def exchange_events(runtime: OverlapRuntime, event_factory: Optional[Callable[[], Any]] = None) -> Any:
    """Inside the block, every :class:`folding.overlap.exchange.Exchange` of ``runtime`` records an event on the
    current stream just before its first collective's wait (after any hand-over to the other lane)
    and one just after its last: the time between them on the device is how long the compute stream
    stood waiting for the exchange, its exposed time. Yields a list of ``(what, before, after)``;
    read them with ``before.elapsed_time(after)`` once the device is synchronized."""
    if event_factory is None:

        def event_factory():
            return torch.cuda.Event(enable_timing=True)

    log: List[tuple] = []

    class _Events(ExchangeObserver):
        def issued(self, ex) -> None:
            if ex.works:
                before, after = event_factory(), event_factory()
                last = len(ex.works) - 1
                ex.works = [
                    _TimedWork(w, before if i == 0 else None, after if i == last else None)
                    for i, w in enumerate(ex.works)
                ]
                log.append((ex.what, before, after))

    with runtime.observe(_Events()):
        yield log


def exposed_by_exchange(log) -> Dict[str, Dict[str, float]]:
    """Per exchange name: count, total and largest exposed milliseconds of :func:`exchange_events`."""
    out: Dict[str, Dict[str, float]] = {}
    for what, before, after in log:
        ms = float(before.elapsed_time(after))
        row = out.setdefault(what, {"count": 0, "total_ms": 0.0, "max_ms": 0.0})
        row["count"] += 1
        row["total_ms"] += ms
        row["max_ms"] = max(row["max_ms"], ms)
    return out


class HostEvent:
    """A host-clock stand-in for ``torch.cuda.Event`` (``record``, ``elapsed_time`` in ms)."""

    def __init__(self):
        self.t = None

    def record(self, stream=None):
        """Take the time now."""
        self.t = time.perf_counter()

    def elapsed_time(self, end: "HostEvent") -> float:
        """Milliseconds from this event to ``end``."""
        return 1e3 * (end.t - self.t)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(cfg, ps, dev, on: bool):
    """The chunks and their optimizer, built with overlap and delayed weight gradients ``on`` (a
    construction setting: one model per mode, from the same seed)."""
    settings = LayerSettings(init_seed=1, device=dev, overlap_comm=on, delay_wgrad=on)
    chunks = build_stage_chunks(model_config=cfg, parallel_state=ps, settings=settings)
    optimizer = FoldedOptimizer(
        torch.nn.ModuleList(chunks), OptimConfig(lr=1e-4, warmup_steps=0, decay_style="constant"), parallel_state=ps
    )
    return chunks, optimizer


def _step(models, ps, mbs, on: bool, runtime: OverlapRuntime):
    chunks, optimizer = models[on]
    optimizer.zero_grad()
    run_microbatches(
        chunks, mbs, parallel_state=ps, loss_scale=1e-4, no_sync=optimizer.no_sync, overlap=on, runtime=runtime
    )
    optimizer.clip_and_step()


def _rank(rank: int, world: int, port: int, cpu: bool, out_dir: str) -> None:
    size = SIZES["cpu" if cpu else "gpu"]
    dev = torch.device("cpu") if cpu else torch.device("cuda", rank)
    if not cpu:
        torch.cuda.set_device(dev)
    kw = dict(device_id=dev) if not cpu else {}
    dist.init_process_group(
        "gloo" if cpu else "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **kw
    )
    layout = ParallelLayout(world_size=world, ep=world, etp=1)
    ps = build_parallel_state(layout, own_communicators=True)  # as the trainer builds them under overlap
    runtime = OverlapRuntime()  # every step's: the exchange events subscribe to it
    try:
        cfg = get_preset(
            "mixtral_tiny",
            hidden_size=size["hidden"],
            num_layers=LAYERS,
            moe=dict(ffn_hidden_size=size["ffn"], num_experts=EXPERTS, topk=2, aux_loss_coeff=0.0),
        )
        models = {on: _model(cfg, ps, dev, on) for on in (False, True)}
        gen = torch.Generator().manual_seed(1000 + rank)
        mbs = []
        for _ in range(MICROBATCHES):
            tok = torch.randint(0, cfg.vocab_size, (1, size["seq"] + 1), generator=gen)
            mbs.append(dict(tokens=tok[:, :-1], labels=tok[:, 1:], loss_mask=torch.ones(tok[:, 1:].shape)))
        _step(models, ps, mbs, on=True, runtime=runtime)  # warm-up (the kernels and communicators both models use)
        result = {"world": world, "ep": ps.coords.ep.size, "device": str(dev)}
        with captured_warnings() as records:
            if not cpu:
                torch.cuda.synchronize(dev)
                torch.cuda.set_sync_debug_mode("warn")
            try:
                _step(models, ps, mbs, on=True, runtime=runtime)
            finally:
                if not cpu:
                    torch.cuda.set_sync_debug_mode("default")
        result["syncs_by_site"] = sync_sites(records) if not cpu else None
        for name, on in (("off", False), ("on", True)):
            with exchange_events(runtime, HostEvent if cpu else None) as log:
                _step(models, ps, mbs, on=on, runtime=runtime)
            if not cpu:
                torch.cuda.synchronize(dev)
            result[f"exposed_{name}"] = exposed_by_exchange(log)
        result["step_ms"] = {"own_communicators": _timed_step(models, ps, mbs, runtime, dev, cpu)}
        shared = build_parallel_state(layout, own_communicators=False)  # the groups shared by rank list
        try:
            models = {True: _model(cfg, shared, dev, True)}
            _step(models, shared, mbs, on=True, runtime=runtime)  # warm-up of the shared communicators
            with exchange_events(runtime, HostEvent if cpu else None) as log:
                result["step_ms"]["shared"] = _timed_step(models, shared, mbs, runtime, dev, cpu)
            result["exposed_on_shared"] = exposed_by_exchange(log)
        finally:
            shared.destroy()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        runtime.close()
        ps.destroy()
        release_process_groups()  # frees the groups' native threads before exit


def _timed_step(models, ps, mbs, runtime: OverlapRuntime, dev, cpu: bool) -> float:
    """Milliseconds of one overlapped step (:func:`_step` with overlap on) between two events on the compute
    stream (host clocks on CPU ranks), the device synchronized before and after."""
    if cpu:
        start, end = HostEvent(), HostEvent()
    else:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if not cpu:
        torch.cuda.synchronize(dev)
    start.record()
    _step(models, ps, mbs, on=True, runtime=runtime)
    end.record()
    if not cpu:
        torch.cuda.synchronize(dev)
    return float(start.elapsed_time(end))


def overlap_step(world: Optional[int] = None, *, cpu: bool = False) -> dict:
    """Run the steps (module docstring) on ``world`` ranks (default: the visible GPUs, at most 4);
    return rank 0's result with every rank's exposed totals. Without CUDA (and not ``cpu``):
    ``{"skipped": ...}``."""
    if not cpu and not torch.cuda.is_available():
        return {"skipped": NO_CUDA}
    if world is None:
        world = 2 if cpu else min(torch.cuda.device_count(), 4)
    if world < 1 or (not cpu and world > torch.cuda.device_count()):
        raise ValueError(f"--world {world}: this box has {0 if cpu else torch.cuda.device_count()} GPU(s)")
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank, args=(world, _free_port(), cpu, out_dir), nprocs=world, join=True)
        per_rank = []
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                per_rank.append(json.load(f))
    result = per_rank[0]
    result["exposed_total_ms_by_rank"] = {
        mode: [sum(v["total_ms"] for v in r[f"exposed_{mode}"].values()) for r in per_rank] for mode in ("off", "on")
    }
    result["step_ms_by_rank"] = {k: [r["step_ms"][k] for r in per_rank] for k in ("own_communicators", "shared")}
    return result
