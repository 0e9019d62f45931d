"""Overlap of MoE communication (``parallel.overlap_moe_comm``): the order audit and the link model.

The order audit trains one step of a small MoE model on 4 gloo ranks with overlap on, recording for
every EP exchange the compute operations issued between its start and its wait
(:func:`folding.testing.overlap_audit.audit`). In the steady state of the schedule (its forward-backward
pairs) every exchange must have some: the other micro-batch's compute ran while it was in flight.
The same audit run with the pairs executed one lane after the other (overlap disabled inside the
schedule) finds exchanges with none, which shows the audit can fail. Setting
``FOLDING_AUDIT_DISABLE_PAIRS=1`` runs the first test that way (it then fails).

The same run traces, per lane, each shared expert's forward and each count read (Qwen2-MoE on EP2 x ETP2
has a shared expert): every MoE forward issues its shared expert before its count read, in the pairs'
lanes and outside them. The groups are built as the trainer builds them with overlap
(``own_communicators=True``).

Equality of results with overlap on and off is checked by the layout-equivalence suite
(``test_pipeline_training.py``), every case with both settings.
"""

import contextlib
import dataclasses
import os
import time

import pytest
import torch
import torch.distributed as dist

from folding.model.chunks import build_stage_chunks
from folding.model.presets import get_preset
from folding.moe.dispatch import host_sync
from folding.moe.layer import SharedExpert
from folding.moe.settings import LayerSettings
from folding.overlap.exchange import Exchange
from folding.overlap.runtime import OverlapRuntime
from folding.parallel import ParallelLayout, build_parallel_state
from folding.pipeline.stage import run_microbatches
from folding.testing import overlap_audit
from folding.testing.link_model_v1 import link_latency

LAYOUTS = {
    "ep4": dict(ep=4, etp=1),
    "pp2ep2": dict(pp=2, ep=2, etp=1),
    "ep2etp2": dict(tp=2, ep=2, etp=2),
    # the hierarchical dispatcher, the 4 ranks as 2 nodes of 2: its rail and node exchanges both audited
    "hier_ep4": dict(ep=4, etp=1, nvlink_domain=2),
}


def _sequential(first, second):
    return first(), second()


@contextlib.contextmanager
def _order_trace(chunks, runtime):
    """Record ``(event, lane)`` for every shared-expert forward and every host read of the dispatchers'
    counts (``host_sync.start_read``) inside the block."""
    trace, undo = [], []

    def mark(what):
        trace.append((what, runtime.running_lane()))

    def wrap(obj, name, what):
        real = getattr(obj, name)

        def call(*a, **k):
            mark(what)
            return real(*a, **k)

        setattr(obj, name, call)
        undo.append(lambda: setattr(obj, name, real) if obj is host_sync else delattr(obj, name))

    wrap(host_sync, "start_read", "read")
    for m in (m for chunk in chunks for m in chunk.modules() if isinstance(m, SharedExpert)):
        wrap(m, "forward", "shared")
    try:
        yield trace
    finally:
        for u in undo:
            u()


def _audit_step(layout: str, sequential: bool):
    """One training step's forward-backward with overlap on (its groups built as the trainer builds them
    then: ``own_communicators``), under the audit; returns the log and the order trace of the shared
    experts and the count reads (:func:`_order_trace`)."""
    runtime = OverlapRuntime()
    if sequential:
        runtime.run_pair = _sequential  # overlap disabled inside the schedule
    with runtime:
        cfg = get_preset("qwen2_moe_tiny" if layout == "ep2etp2" else "mixtral_tiny", num_layers=2)
        if layout.startswith("hier"):
            cfg = dataclasses.replace(cfg, moe=cfg.moe.replace(dispatcher="hierarchical"))
        lay = ParallelLayout(world_size=dist.get_world_size(), **LAYOUTS[layout])
        ps = build_parallel_state(lay, own_communicators=True)
        try:
            chunks = build_stage_chunks(model_config=cfg, parallel_state=ps, settings=LayerSettings(overlap_comm=True))
            gen = torch.Generator().manual_seed(ps.rank // (ps.coords.tp.size * ps.coords.pp.size))
            mbs = []
            for _ in range(8):  # pairs on every stage: PP2's first stage warms up with 3 forwards
                tok = torch.randint(0, cfg.vocab_size, (1, 17), generator=gen)
                mbs.append(dict(tokens=tok[:, :-1], labels=tok[:, 1:], loss_mask=torch.ones(1, 16)))
            with overlap_audit.audit(runtime) as log, _order_trace(chunks, runtime) as trace:
                run_microbatches(chunks, mbs, parallel_state=ps, loss_scale=1e-3, overlap=True, runtime=runtime)
        finally:
            ps.destroy()
    return log, trace


def _violations(log):
    """The steady-state EP exchanges with no compute between their start and their wait."""
    return [e for e in log if e["steady"] and e["what"].startswith("ep") and e["ops"] == 0]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_order_audit_every_steady_exchange_hides_behind_compute(ranks, layout):
    sequential = os.environ.get("FOLDING_AUDIT_DISABLE_PAIRS") == "1"
    for r, (log, trace) in enumerate(ranks(4).run(_audit_step, layout, sequential)):
        # every MoE forward issues its shared expert (Qwen2-MoE's) before its count read, in every lane
        for lane in {la for _, la in trace}:
            mine = [e for e, la in trace if la == lane]
            shared = "shared" in mine
            assert mine == (["shared", "read"] if shared else ["read"]) * (len(mine) // (1 + shared)), (r, lane, mine)
        assert (layout == "ep2etp2") == any(e == "shared" for e, _ in trace) and "read" in {e for e, _ in trace}
        steady = [e for e in log if e["steady"] and e["what"].startswith("ep")]
        # at least two pairs of 4 EP exchanges per MoE layer (dispatch and combine, forward and backward)
        assert len(steady) >= 8, (layout, r, log)
        bad = _violations(log)
        assert not bad, (
            f"{layout} rank {r}: {len(bad)} of {len(steady)} steady-state exchanges had no compute: {bad[:4]}"
        )
        # the count read hands over too: the other lane runs while the counts travel
        assert all(e["paired"] for e in steady if e["what"].endswith(("dispatch", "counts"))), (layout, r)
        assert any(e["what"] == "ep counts" for e in steady), (layout, r)
        if layout.startswith("hier"):  # both stages ran, each its own overlap point
            assert {"ep rail dispatch", "ep node dispatch", "ep rail combine", "ep node combine"} <= {
                e["what"] for e in steady
            }, (layout, r)


def test_order_audit_fails_with_overlap_disabled_inside_the_schedule(ranks):
    for r, (log, _) in enumerate(ranks(4).run(_audit_step, "ep4", True)):
        steady = [e for e in log if e["steady"] and e["what"].startswith("ep")]
        # every token exchange (the count gathers have their own lane's permutation before their read)
        tokens = [e for e in steady if e["what"] != "ep counts"]
        assert tokens and len(_violations(log)) == len(tokens), (r, log)


def _timed_exchange(latency_s: float):
    x = torch.ones(4, 8)
    out = torch.empty_like(x)
    t0 = time.perf_counter()
    runtime = OverlapRuntime()
    with runtime.active(), link_latency(runtime, latency_s):
        w = dist.all_to_all_single(out, x, group=None, async_op=True)
        Exchange([w], what="ep test").wait()
    return time.perf_counter() - t0


def test_link_model_delays_each_exchange_by_at_least_its_latency(ranks):
    for took in ranks(4).run(_timed_exchange, 0.05):
        assert took >= 0.05
