"""The NCCL-order overlap benchmark's own logic (``benchmarks.bench_overlap_nccl``), without running a
model: the interleaved run order, the summary over repeats and its targets, the report's tables, the
command line; and ``bench_overlap``'s defaults (NCCL's order and the metadata communicator on)."""

from types import SimpleNamespace

import pytest

from benchmarks import bench_overlap as bo
from benchmarks import bench_overlap_nccl as bn
from folding.testing.overlap_audit import WaitStats


def _run(setting, layout, hidden, ratio, counts_on=0.1):
    return dict(
        setting=setting,
        layout=layout,
        hidden=hidden,
        step_time_ratio=ratio,
        step_time_off_s=2.0,
        step_time_on_s=2.0 * ratio,
        exposed_off_s=1.0,
        exposed_on_s=1.0 - (hidden or 0.0),
        exposed_by_off_s={"ep counts": 0.2, "ep dispatch": 0.8},
        exposed_by_on_s={"ep counts": counts_on},
        load_before=(1.0, 1.0, 1.0),
        load_after=(4.0, 2.0, 1.0),
    )


def test_schedule_interleaves_and_rotates():
    names = [n for n, _ in bn.SETTINGS]
    reps = len(names)
    order = bn.schedule(["ep4", "pp2ep2"], reps)
    assert len(order) == reps * 2 * len(names)
    for rep in range(reps):
        for layout in ("ep4", "pp2ep2"):
            got = [n for r, lay, n in order if r == rep and lay == layout]
            assert sorted(got) == sorted(names)  # each setting once per repeat and layout
    firsts = {order[2 * len(names) * rep][2] for rep in range(reps)}
    assert firsts == set(names)  # no setting always runs first
    default = dict(nccl_order=True, peer_issue=True, meta_comm=True)
    assert bn.SETTINGS[-1][1] == default  # the default comes last in the list


def test_summary_medians_ranges_and_targets():
    runs = [
        _run("rule, ep_meta", "ep4", 0.72, 0.70),
        _run("rule, ep_meta", "ep4", 0.80, 0.60),
        _run("rule, ep_meta", "ep4", 0.50, 0.90),
        _run("no rule", "ep4", 0.71, 0.76),
        _run("rule, counts on EP", "ep4", None, 1.0),
    ]
    rows = {(r["setting"], r["layout"]): r for r in bn.summarize(runs)}
    meta = rows[("rule, ep_meta", "ep4")]
    assert meta["repeats"] == 3 and meta["hidden_median"] == 0.72 and meta["hidden_range"] == [0.50, 0.80]
    assert meta["ratio_median"] == 0.70 and meta["ratio_range"] == [0.60, 0.90] and meta["meets_targets"]
    assert not rows[("no rule", "ep4")]["meets_targets"]  # 0.76 > 0.75
    assert rows[("rule, counts on EP", "ep4")]["hidden_median"] is None
    assert not rows[("rule, counts on EP", "ep4")]["meets_targets"]
    text = bn.report(bn.summarize(runs), runs, bn._args(["--repeats", "3"]), "python -m x")
    assert "| rule, ep_meta | ep4 | 0.72 [0.50, 0.80] | 0.70 [0.60, 0.90] | yes |" in text
    assert "| no rule | ep4 | 0.71 [0.71, 0.71] | 0.76 [0.76, 0.76] | no |" in text
    assert "| (1.0, 1.0, 1.0) | (4.0, 2.0, 1.0) |" in text  # every run's load
    assert "| rule, ep_meta | ep4 | 0.200 → 0.100 | 0.800 → 0.000 |" in text  # exposed by exchange


def test_command_lines():
    with pytest.raises(SystemExit):
        bn._args(["--layouts", "ep4,ep8"])
    with pytest.raises(SystemExit):
        bn._args(["--repeats", "0"])
    ns = bn._args([])
    assert ns.layouts == "ep4,pp2ep2" and ns.latency_ms == 10.0
    a = bn._base(bn._args(["--steps", "4", "--warmup", "1"]))
    assert a["steps"] == 4 and a["warmup"] == 1 and a["latency_ms"] == 10.0
    assert a["nccl_order"] and a["meta_comm"]  # bench_overlap's defaults: NCCL's order, counts on ep_meta
    one = bo._args([])
    assert one.nccl_order and one.meta_comm


def test_exposed_time_is_split_by_what_was_waited_on():
    waits = WaitStats()
    for what, seconds in (("ep counts", 0.25), ("ep dispatch", 0.5), ("ep counts", 0.25)):
        waits.finished(SimpleNamespace(what=what), seconds)
    assert waits.blocked_s == 1.0
    assert waits.blocked_by == {"ep counts": 0.5, "ep dispatch": 0.5}
    waits.reset()
    assert waits.blocked_by == {} and waits.blocked_s == 0.0
