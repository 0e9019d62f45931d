"""Imbalance-aware planning: the slowest EP rank's load from routed-token counts, against hand-worked values;
zipf:0 (and a balanced trace) equal the balanced plan exactly; a skew slows expert-parallel layouts and
changes the ranking where it should; trace files and the CLI's errors."""

import json

import numpy as np
import pytest

from folding.model.presets import get_preset
from folding.planning.hardware import get_gpu
from folding.planning.imbalance import (
    RoutingModel,
    load_routing_trace,
    parse_skew,
    quantile_step,
    rank_loads,
    register_trace_reader,
    topk_feasible,
    zipf_loads,
)
from folding.planning.planner import plan_layouts
from folding.planning.step_time import Cluster, Plan, TrainingShape, estimate_step_time
from tools import plan as plan_tool

MIXTRAL = get_preset("mixtral_8x7b")  # 32 MoE layers, 8 experts
CLUSTER = Cluster(gpu=get_gpu("h100"), num_gpus=16)
SHAPE = TrainingShape(seq_length=4096, global_batch_size=64)
H8 = sum(1 / r for r in range(1, 9))  # zipf:1 normalizer over 8 experts


def test_balanced_counts_give_exactly_one():
    for loads in (np.full((3, 4, 64), 7.0), zipf_loads(num_experts=49, num_layers=3, steps=5, exponent=0.0, seed=1)):
        for ep in (1, 8, 64) if loads.shape[-1] == 64 else (1, 7, 49):
            r = rank_loads(loads, ep=ep, rows_per_expert=100.0)
            assert np.all(r.compute == 1.0) and np.all(r.comm == 1.0) and np.all(r.max_over_mean == 1.0)
            assert np.all(r.dropped == 0.0)


def test_zipf1_by_hand_ep8_vs_ep2():
    # popularity 1/rank in expert order (rank 1 = expert 0): EP8's slowest rank holds expert 0 alone,
    # EP2's first rank holds experts 0-3
    loads = (1.0 / np.arange(1, 9))[None, None, :]
    r8 = rank_loads(loads, ep=8, rows_per_expert=1.0)
    r2 = rank_loads(loads, ep=2, rows_per_expert=1.0)
    assert r8.compute[0] == pytest.approx(8 / H8)  # 2.943
    assert r2.compute[0] == pytest.approx(2 * (1 + 1 / 2 + 1 / 3 + 1 / 4) / H8)  # 1.533
    assert rank_loads(loads, ep=1, rows_per_expert=1.0).compute[0] == pytest.approx(1.0)


def test_capacity_drops_padding_and_alignment():
    loads = np.array([[[4.0, 2.0, 1.0, 1.0]]])  # shares x = 2, 1, 0.5, 0.5 of the mean
    r = rank_loads(loads, ep=4, rows_per_expert=1.0, capacity_factor=1.25)
    assert r.comm[0] == pytest.approx(1.25) and r.dropped[0] == pytest.approx(0.75 / 4)
    assert r.max_over_mean[0] == pytest.approx(2.0)  # before drops
    padded = rank_loads(loads, ep=2, rows_per_expert=1.0, capacity_factor=1.25, pad_to_capacity=True)
    assert padded.comm[0] == pytest.approx(1.25) and padded.compute[0] == pytest.approx(1.25)
    # 10 balanced rows per expert, aligned to 16: expert rows 20 -> 32, 10 -> 16, 5 -> 16, 5 -> 16
    al = rank_loads(loads, ep=2, rows_per_expert=10.0, align=16)
    assert al.comm[0] == pytest.approx(1.5) and al.compute[0] == pytest.approx((32 + 16) / 2 / 10)


def test_quantile_step_nearest_rank():
    keys = np.array([5.0, 1.0, 3.0, 2.0, 4.0])
    assert quantile_step((keys,), 0.5) == 2  # 3.0
    assert quantile_step((keys,), 0.99) == 0  # 5.0


def test_zipf_draws_are_seeded_and_skewed():
    a = zipf_loads(num_experts=8, num_layers=2, steps=4, exponent=1.2, seed=3)
    assert np.array_equal(a, zipf_loads(num_experts=8, num_layers=2, steps=4, exponent=1.2, seed=3))
    assert not np.array_equal(a, zipf_loads(num_experts=8, num_layers=2, steps=4, exponent=1.2, seed=4))
    w = 1 / np.arange(1, 9) ** 1.2
    assert np.allclose(np.sort(a[1, 1]), np.sort(w / w.sum()))
    assert not np.array_equal(a[0, 0], a[1, 0])  # a fresh permutation per step


def test_topk_cap():
    # top-2 over 4 experts: shares 0.8, 0.1, 0.05, 0.05 -> 0.5, then 0.5 split 2:1:1
    assert np.allclose(topk_feasible(np.array([0.8, 0.1, 0.05, 0.05]), 2), [0.5, 0.25, 0.125, 0.125])
    shares = np.array([0.4, 0.35, 0.15, 0.1])  # top-4 over 4 experts: every token uses all of them
    assert np.allclose(topk_feasible(shares, 4), 0.25)
    draws = zipf_loads(num_experts=64, num_layers=2, steps=3, exponent=1.2, seed=0, topk=8)
    assert draws.max() == pytest.approx(1 / 8) and np.allclose(draws.sum(-1), 1.0)
    mild = np.array([0.3, 0.3, 0.2, 0.2])
    assert np.array_equal(topk_feasible(mild, 2), mild)


def _rows(results):
    return [(r.plan, r.time.step_s, r.time.breakdown, r.memory.total) for r in results]


def test_zipf0_equals_balanced_plan_exactly():
    balanced = plan_layouts(MIXTRAL, cluster=CLUSTER, shape=SHAPE)
    for rank_by in ("p50", "p99"):
        loads = zipf_loads(num_experts=8, num_layers=32, steps=20, exponent=0.0, seed=0)
        skewed = plan_layouts(
            MIXTRAL, cluster=CLUSTER, shape=SHAPE, routing=RoutingModel(loads, MIXTRAL, rank_by=rank_by)
        )
        assert _rows(skewed) == _rows(balanced)
        assert all(r.routing.p50.step_s == r.routing.p99.step_s == r.time.step_s for r in skewed)


def test_skew_slows_ep_not_ep1_and_changes_ranking():
    # the default compute efficiency is the planner's calibrated one
    assert plan_tool.COMPUTE_EFFICIENCY == 0.651
    loads = zipf_loads(num_experts=8, num_layers=32, steps=50, exponent=1.0, seed=0)
    routing = RoutingModel(loads, MIXTRAL, rank_by="p50")
    balanced = plan_layouts(MIXTRAL, cluster=CLUSTER, shape=SHAPE)
    skewed = plan_layouts(MIXTRAL, cluster=CLUSTER, shape=SHAPE, routing=routing)
    for r in skewed:  # (the fastest variant of a mapping may differ from the balanced plan's)
        base = estimate_step_time(MIXTRAL, r.plan, shape=SHAPE, cluster=CLUSTER, compute_efficiency=0.651).step_s
        assert r.routing.p50.step_s <= r.routing.p99.step_s
        if r.plan.ep == 1:
            assert r.time.step_s == base
        else:
            assert r.time.step_s > base
    # EP8 puts the hottest expert (37% of the tokens) alone on a rank: 2.9x the balanced expert work
    ep8 = next(r for r in skewed if r.plan.ep == 8)
    assert ep8.routing.load_p50.max_over_mean == pytest.approx(8 / H8)
    assert balanced[0].plan.ep == 8 and skewed[0].plan.ep < 8


def test_step_time_load_factor_scales_moe_terms():
    plan = Plan(tp=1, cp=1, pp=1, vpp=1, ep=8, etp=1, dp=16, edp=2, distributed_optimizer=True, recompute="none")
    kw = dict(shape=SHAPE, cluster=CLUSTER, compute_efficiency=0.651)
    base = estimate_step_time(MIXTRAL, plan, **kw)
    assert estimate_step_time(MIXTRAL, plan, moe_load=(1.0, 1.0), **kw) == base
    comm = estimate_step_time(MIXTRAL, plan, moe_load=(1.0, 2.0), **kw)
    assert comm.breakdown["ep"] > base.breakdown["ep"] and comm.breakdown["compute"] == base.breakdown["compute"]
    comp = estimate_step_time(MIXTRAL, plan, moe_load=(2.0, 1.0), **kw)
    assert comp.breakdown["compute"] > base.breakdown["compute"] and comp.breakdown["ep"] == base.breakdown["ep"]


def test_trace_formats(tmp_path):
    counts = np.arange(2 * 3 * 4, dtype=np.float64).reshape(2, 3, 4) + 1
    np.save(tmp_path / "t.npy", counts)
    (tmp_path / "a.json").write_text(json.dumps(counts.tolist()))
    (tmp_path / "o.json").write_text(json.dumps({"counts": counts.tolist()}))
    for name in ("t.npy", "a.json", "o.json"):
        assert np.array_equal(load_routing_trace(str(tmp_path / name)), counts)
    (tmp_path / "x.loadtest").write_bytes(b"")
    with pytest.raises(ValueError, match="unknown format"):
        load_routing_trace(str(tmp_path / "x.loadtest"))
    register_trace_reader(".loadtest", lambda path: counts * 2)
    assert np.array_equal(load_routing_trace(str(tmp_path / "x.loadtest")), counts * 2)
    (tmp_path / "flat.json").write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match="steps, layers, experts"):
        load_routing_trace(str(tmp_path / "flat.json"))
    with pytest.raises(ValueError, match="32 x 8"):
        RoutingModel(counts, MIXTRAL)


def test_cli_balanced_trace_equals_balanced(tmp_path, capsys):
    np.save(tmp_path / "even.npy", np.full((3, 32, 8), 512.0))
    base = ["--model", "mixtral_8x7b", "--world", "16", "--seq-length", "4096", "--global-batch-size", "64", "--json"]
    assert plan_tool.main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plan_tool.main(base + ["--routing-trace", str(tmp_path / "even.npy"), "--rank-by", "p99"]) == 0
    traced = json.loads(capsys.readouterr().out)
    assert [r["routing"]["p99_step_s"] for r in traced] == [r["step_s"] for r in plain]
    assert [{k: v for k, v in r.items() if k != "routing"} for r in traced] == plain


def test_cli_reads_the_engine_s_own_trace(tmp_path, capsys):
    """A moe.trace_dir recorded by training plans like the same counts as .npy (routed = kept + dropped,
    summed over source ranks)."""
    from folding.training.telemetry.trace_file import TraceWriter, make_header, trace_path

    rng = np.random.default_rng(0)
    header = make_header(
        model="hand", layer_numbers=list(range(32)), num_experts=8, topk=2, source_ranks=2, layout={"ep": 2}
    )
    writer = TraceWriter(trace_path(str(tmp_path / "trace")), header, start_step=1)
    total = []
    for step in range(1, 4):
        kept_LRE = rng.integers(100, 400, size=(32, 2, 8))
        dropped_LRE = rng.integers(0, 20, size=(32, 2, 8))
        writer.append(step, kept_LRE, dropped_LRE)
        total.append((kept_LRE + dropped_LRE).sum(axis=1))
    writer.close()
    np.save(tmp_path / "same.npy", np.asarray(total, dtype=np.float64))
    base = ["--model", "mixtral_8x7b", "--world", "16", "--seq-length", "4096", "--global-batch-size", "64", "--json"]
    assert plan_tool.main(base + ["--routing-trace", str(tmp_path / "same.npy")]) == 0
    from_npy = json.loads(capsys.readouterr().out)
    for path in (tmp_path / "trace", tmp_path / "trace" / "routing_trace.bin"):
        assert plan_tool.main(base + ["--routing-trace", str(path)]) == 0
        assert json.loads(capsys.readouterr().out) == from_npy
    assert from_npy[0]["routing"]["p50_step_s"] > 0


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--routing-skew", "zipf:-1"], "zipf:S with S >= 0"),
        (["--routing-skew", "uniform"], "zipf:S"),
        (["--routing-skew", "zipf:1", "--routing-trace", "x.npy"], "exclusive"),
        (["--routing-trace", "missing.npy"], "no such file"),
    ],
)
def test_cli_bad_routing_flags(extra, message, capsys):
    argv = ["--model", "mixtral_8x7b", "--world", "16", "--seq-length", "4096", "--global-batch-size", "64"]
    assert plan_tool.main(argv + extra) == 2
    assert message in capsys.readouterr().err
    assert parse_skew("zipf:1.5") == 1.5
