"""The replica slot planner, the deterministic token split, the re-plan schedule and the settings'
errors (``moe.expert_replicas``, ``moe.replica_interval``)."""

import dataclasses
import itertools

import pytest
import torch

from folding.moe.config import MoEConfig
from folding.moe.replicas import fetch as replica_fetch
from folding.moe.replicas.table import (
    EMPTY,
    IndexCache,
    ReplicaSchedule,
    check_replica_layout,
    check_table,
    expert_copies,
    plan_replicas,
    projected_rank_loads,
    slot_experts,
    split_to_slots,
)
from folding.testing.transfer_audit import TransferAudit

GEO = dict(ep_size=4, num_local_experts=2, num_replicas=1)


def test_balanced_load_gets_no_replica():
    assert plan_replicas([5.0] * 8, **GEO) == (EMPTY,) * 4
    assert plan_replicas([0.0] * 8, **GEO) == (EMPTY,) * 4


def test_hottest_expert_goes_to_least_loaded_rank_with_deterministic_ties():
    # expert 0 (rank 0) is hot; ranks 1..3 tie at load 2: the replica goes to rank 1 (lowest)
    load = [10, 0, 1, 1, 1, 1, 1, 1]
    table = plan_replicas(load, **GEO)
    assert table[1] == 0  # rank 1's slot
    assert plan_replicas(load, **GEO) == table  # deterministic
    loads = projected_rank_loads(load, table, **GEO)
    assert max(loads) < 10  # the peak went down
    check_table(table, **GEO)
    # equal hot experts: the lower index is served first
    t2 = plan_replicas([8, 0, 8, 0, 0, 0, 0, 0], ep_size=4, num_local_experts=2, num_replicas=1)
    assert t2.index(0) < t2.index(2)


def test_plan_spreads_a_very_hot_expert_and_never_places_on_its_owner():
    load = [100, 10, 10, 10, 5, 5, 5, 5]
    geo = dict(ep_size=2, num_local_experts=4, num_replicas=2)
    table = plan_replicas(load, **geo)
    check_table(table, **geo)
    assert table[:2] == (EMPTY, EMPTY)  # rank 0 owns the hot experts: nothing of its own comes back
    before = projected_rank_loads(load, (EMPTY,) * 4, **geo)
    after = projected_rank_loads(load, table, **geo)
    assert max(after) / (sum(after) / 2) < max(before) / (sum(before) / 2)
    assert sum(after) == pytest.approx(sum(before))


def test_plan_reaches_the_hand_worked_best_plan():
    # EP=3 ranks, L=2 experts each (rank 0: e0 e1, rank 1: e2 e3, rank 2: e4 e5), R=1 slot per rank.
    # Loads 12 6 3 3 0 0: ranks 18 6 0 (24 in all, 8 each would be even).
    # By hand: rank 0 always keeps its own copies, so its load is 12/c0 + 6/c1 with c0, c1 the copies
    # of e0, e1; only ranks 1 and 2 can add one (a copy on rank 0 only adds to rank 0), so
    # c0 + c1 <= 4: (3,1) -> 4+6 = 10, (2,2) -> 6+3 = 9, (2,1) -> 12, (1,2) -> 15, (1,3) -> 14.
    # The best rank 0 is 9: one copy of e0 and one of e1. If e0's goes to rank 1, rank 1 has 6+6 = 12;
    # so e0 -> rank 2 (0+6 = 6) and e1 -> rank 1 (6+3 = 9): ranks 9 9 6, peak 9, rank 0's slot empty.
    # A rule that only copies the hottest expert again would stop at (3,1): ranks 10 10 4.
    load = [12, 6, 3, 3, 0, 0]
    geo = dict(ep_size=3, num_local_experts=2, num_replicas=1)
    table = plan_replicas(load, **geo)
    assert table == (EMPTY, 1, 0)
    assert projected_rank_loads(load, table, **geo) == [9.0, 9.0, 6.0]
    # and no valid table does better (all 7^3 tables, the invalid ones skipped)
    best = None
    for cand in itertools.product(range(EMPTY, 6), repeat=3):
        try:
            check_table(cand, **geo)
        except ValueError:
            continue
        loads = sorted(projected_rank_loads(load, cand, **geo), reverse=True)
        best = loads if best is None or loads < best else best
    assert best == [9.0, 9.0, 6.0]


def test_zipf_16_experts_ep4_two_slots_reaches_the_target():
    load = [1 / (i + 1) ** 1.2 for i in range(16)]
    geo = dict(ep_size=4, num_local_experts=4, num_replicas=2)
    loads = projected_rank_loads(load, plan_replicas(load, **geo), **geo)
    assert max(loads) / (sum(loads) / 4) <= 1.15


def test_copies_and_slot_experts():
    table = (EMPTY, 0, 0, 3)  # rank 1 and 2 hold expert 0, rank 3 holds expert 3
    assert expert_copies(table, **GEO) == {0: [0, 5, 8], 3: [4, 11]}
    assert slot_experts(table, **GEO) == [0, 1, -1, 2, 3, 0, 4, 5, 0, 6, 7, 3]
    with pytest.raises(ValueError, match="on its owner"):
        check_table((0, EMPTY, EMPTY, EMPTY), **GEO)
    with pytest.raises(ValueError, match="entries"):
        check_table((EMPTY,), **GEO)


def test_split_is_contiguous_and_near_equal():
    T = 10
    map_TE = torch.zeros(T, 8, dtype=torch.bool)
    map_TE[:, 0] = True
    map_TE[1::2, 3] = True  # 5 pairs of expert 3
    map_TE[0::2, 7] = True
    probs = torch.rand(T, 8)
    table = (EMPTY, 0, 0, 3)
    m, p = split_to_slots(map_TE, probs, table, **GEO)
    assert m.shape == (T, 12) and p.shape == (T, 12)
    assert torch.equal(m.sum(1), map_TE.sum(1))  # every pair kept exactly once
    rows0 = [m[:, s].nonzero().flatten().tolist() for s in (0, 5, 8)]
    assert rows0 == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]  # floor(i*3/10): 4, 3, 3 in token order
    rows3 = [m[:, s].nonzero().flatten().tolist() for s in (4, 11)]
    assert rows3 == [[1, 3, 5], [7, 9]]
    assert torch.equal(m[:, 10], map_TE[:, 7])  # unreplicated: its owned slot
    for s, e in enumerate(slot_experts(table, **GEO)):
        if e >= 0:
            assert torch.equal(p[:, s], probs[:, e])
    assert not m[:, 2].any()  # the empty slot


class _Layer:
    def __init__(self, n):
        self.layer_number, self.tables = n, []

    def replica_geometry(self):
        return GEO

    @property
    def replica_table(self):  # as MoELayer: the table installed last, empty before the first plan
        return self.tables[-1] if self.tables else (-1,) * (GEO["ep_size"] * GEO["num_replicas"])

    def set_replica_table(self, table):
        self.tables.append(table)


def test_schedule_replans_every_interval_from_the_interval_loads():
    a = _Layer(3)
    s = ReplicaSchedule([a], interval=2)
    assert not s.observe({3: [0, 0, 9, 0, 0, 0, 0, 0]})
    assert s.observe({3: [1, 0, 0, 0, 0, 0, 0, 0]})
    assert a.tables == [plan_replicas([1, 0, 9, 0, 0, 0, 0, 0], **GEO)]
    assert not s.observe({3: [9, 0, 0, 0, 0, 0, 0, 0]})
    assert s.observe({3: [0] * 8})  # the second interval forgets the first
    assert a.tables[1] == plan_replicas([9, 0, 0, 0, 0, 0, 0, 0], **GEO)
    with pytest.raises(ValueError, match="moe.replica_interval=0"):
        ReplicaSchedule([a], interval=0)


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(expert_replicas=-1), r"moe.expert_replicas=-1: must be an integer >= 0"),
        (dict(expert_replicas=1, replica_interval=0), r"moe.replica_interval=0: must be an integer >= 1"),
        (dict(expert_replicas=1, capacity_factor=1.0, pad_to_capacity=True), r"moe.expert_replicas=1: pad_to"),
        (dict(expert_replicas=1, expert_backend="te"), r"moe.expert_replicas=1: the te expert backend"),
    ],
)
def test_bad_settings_name_the_key(changes, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(num_experts=8, topk=2, ffn_hidden_size=8, **changes)


def test_layout_checks():
    cfg = MoEConfig(num_experts=8, topk=2, ffn_hidden_size=8, expert_replicas=2)
    with pytest.raises(ValueError, match=r"moe.expert_replicas=2 needs expert parallelism .*parallel.ep=1"):
        check_replica_layout(cfg, 1)
    check_replica_layout(cfg, 4)


def test_validate_job_refuses_replicas_without_ep():
    from folding.job.config import ConfigError, JobConfig, ParallelConfig, TrainConfig
    from folding.job.validate import validate_job
    from folding.model.presets import get_preset

    def job(**par):
        model = get_preset("mixtral_tiny", hidden_size=32, moe={"ffn_hidden_size": 16, "expert_replicas": 1})
        return JobConfig(
            model=model,
            parallel=ParallelConfig(**par),
            train=TrainConfig(steps=2, global_batch_size=8, micro_batch_size=1, seq_length=16),
        )

    with pytest.raises(ConfigError, match=r"moe.expert_replicas=1: needs expert parallelism.*parallel.ep > 1"):
        validate_job(job(ep=1), world_size=4)
    validate_job(job(ep=4), world_size=4)
    validate_job(job(ep=4, overlap_moe_comm=True), world_size=4)  # overlap is fine
    # and so are delayed weight gradients: the replicas' gradients are returned after the schedule
    validate_job(job(ep=4, overlap_moe_comm=True, delay_wgrad=True), world_size=4)


def test_inference_config_drops_only_training_options():
    from folding.model.presets import get_preset
    from folding.moe.config import TRAINING_ONLY

    trained = get_preset(
        "mixtral_tiny", moe={"expert_replicas": 2, "trace_dir": "t", "dispatch_wire": "fp8", "input_jitter_eps": 0.01}
    )
    plain = trained.for_inference()
    assert plain.moe.expert_replicas == 0 and plain.moe.trace_dir is None and plain.moe.dispatch_wire == "none"
    assert plain.moe.input_jitter_eps is None
    kept = [f for f in dataclasses.fields(plain.moe) if f.name not in TRAINING_ONLY]
    assert all(getattr(plain.moe, f.name) == getattr(trained.moe, f.name) for f in kept)
    assert plain.replace(moe=trained.moe) == trained  # nothing outside the MoE options changed


def test_table_summary_and_replan_message():
    from folding.moe.replicas.table import table_summary
    from folding.training.telemetry.replica_log import replan_message

    # EP2, 2 experts per rank, 1 replica slot each: expert 0 (rank 0) is hot; its copy goes to rank 1
    load = [60, 20, 10, 10]  # rank loads without replicas 80 | 20: max/mean 1.6
    geo = dict(ep_size=2, num_local_experts=2, num_replicas=1)
    table = [-1, 0]
    s = table_summary(load, table, **geo)
    # with the copy expert 0's 60 splits 30 | 30: ranks 50 | 50, max/mean 1.0
    assert s == {"table": [-1, 0], "copies": {"0": [1]}, "max_over_mean": 1.0, "max_over_mean_without": 1.6}
    assert table_summary([0, 0, 0, 0], [-1, -1], **geo)["max_over_mean"] == 1.0
    before = table_summary(load, [-1, -1], **geo)
    msg = replan_message(7, {"layer": 3, "steps": 5, "before": before, "after": s})
    assert msg == (
        "replicas re-planned at step 7, layer 3: expert 0 on EP rank 1; EP-rank max/mean load 1.60 -> 1.00 "
        "over the last 5 steps (without replicas 1.60)"
    )


def test_index_tensors_are_built_once_per_layer_however_many_layers():
    """More MoE layers per rank than a fixed-size cache holds (the former one kept 64 tables): each layer's
    :class:`IndexCache` keeps its table's index tensors, so a second pass over every layer (the next
    micro-batch) copies nothing from the host: neither the token split's nor the fetch's and return's."""
    geo = dict(ep_size=4, num_local_experts=4, num_replicas=2)
    gen = torch.Generator().manual_seed(0)
    loads = [(torch.rand(16, generator=gen) ** 4).tolist() for _ in range(200)]  # skewed: replicas planned
    tables = list(dict.fromkeys(plan_replicas(load, **geo) for load in loads))
    tables = [t for t in tables if expert_copies(t, **geo)][:80]  # some expert replicated
    assert len(tables) == 80  # 80 layers, each with its own table
    map_TE = torch.rand(8, 16, generator=gen) < 0.3
    probs = torch.rand(8, 16, generator=gen)
    slots, routes = [IndexCache() for _ in tables], [IndexCache() for _ in tables]

    def one_pass():
        for table, s, r in zip(tables, slots, routes):
            split_to_slots(map_TE, probs, table, **geo, cache=s)
            replica_fetch._route_tensors(table, 4, 1, 4, 2, probs.device, r)

    one_pass()  # builds every layer's tensors: copies from the host
    with TransferAudit() as audit:
        one_pass()
    assert audit.h2d == 0, audit.events[:4]
    with TransferAudit() as first:  # the audit does see the copies of a first pass
        for table in tables[:3]:
            split_to_slots(map_TE, probs, table, **geo, cache=IndexCache())
    assert first.h2d >= 3
