"""The planner's hierarchical dispatcher and FP8 GEMMs: expected rows per token against brute-force
enumeration of every routing, the ``ep`` term of DeepSeek-V3 TP2 PP16 EP64 on 1,024 H100 falling by the
factor its byte count implies, and the FP8 efficiency reproducing its calibration row."""

import itertools
import math

import pytest

from folding.model.presets import get_preset
from folding.planning.costs import gemm_time
from folding.planning.hardware import FP8_EFFICIENCY, get_gpu
from folding.planning.node_dispatch import exchange_rows, hit_probability
from folding.planning.planner import calibrate_fp8_efficiency, planned_dispatcher
from folding.planning.step_time import Cluster, Plan, TrainingShape, _layer_times
from tools import plan as plan_tool

H100 = get_gpu("h100")


def _brute_rows(E, k, ep, per_node, groups=None, group_topk=None):
    """Average (NIC rows, NVLink rows) of the hierarchical dispatcher for a token on rank 0, over every
    routing: every choice of ``group_topk`` groups (all groups without a limit), then every choice of ``k``
    experts among them, each equally likely. Experts sit in contiguous blocks per rank, ranks per node."""
    per_rank = E // ep
    node_of = lambda e: e // (per_rank * per_node)  # noqa: E731
    rank_of = lambda e: e // per_rank  # noqa: E731
    G = groups or 1
    M = group_topk or G
    per_group = E // G
    nic = nvl = n = 0
    for chosen in itertools.combinations(range(G), M):
        pool = [e for g in chosen for e in range(g * per_group, (g + 1) * per_group)]
        for experts in itertools.combinations(pool, k):
            nodes = {node_of(e) for e in experts}
            ranks = {rank_of(e) for e in experts}
            nic += len(nodes - {0})
            # each hit node's forwarder is its rank with local index 0 (rank 0's position); it sends one
            # row to every other hit rank of its node
            nvl += sum(1 for r in ranks if r % per_node != 0)
            n += 1
    return nic / n, nvl / n


@pytest.mark.parametrize(
    "E,k,ep,per_node,groups,group_topk",
    [
        (12, 3, 6, 2, None, None),  # 3 nodes of 2 ranks, 2 experts per rank
        (16, 4, 8, 4, None, None),  # 2 nodes of 4
        (16, 3, 8, 2, 4, 2),  # node-limited: 4 nodes, one group each, at most 2 per token
        (16, 3, 8, 2, 8, 3),  # node-limited with 2 groups per node (a group per rank)
        (16, 3, 4, 2, 8, 3),  # 2 groups per rank
        (24, 4, 6, 3, 2, 1),  # 2 nodes of 3 ranks, one group each, limited to one node
    ],
)
def test_rows_match_enumeration(E, k, ep, per_node, groups, group_topk):
    rows = exchange_rows(
        num_experts=E,
        topk=k,
        ep=ep,
        ranks_per_node=per_node,
        dispatcher="hierarchical",
        num_groups=groups,
        group_topk=group_topk,
    )
    nic, nvl = _brute_rows(E, k, ep, per_node, groups, group_topk)
    assert rows.nic == pytest.approx(nic, rel=1e-12)
    assert rows.nvlink == pytest.approx(nvl, rel=1e-12)
    if group_topk:  # at most group_topk nodes, one of them possibly the source's own
        assert rows.nic <= group_topk


def test_alltoall_rows_are_the_remote_copies():
    r = exchange_rows(num_experts=256, topk=8, ep=64, ranks_per_node=8, dispatcher="alltoall")
    assert r.nic == 7.0  # 8 copies, 56 of the 63 other ranks on other nodes: 8 * 56/64
    assert r.nvlink == pytest.approx(8 * 7 / 64)
    # inside one node both dispatchers are one exchange
    one = exchange_rows(num_experts=64, topk=8, ep=8, ranks_per_node=8, dispatcher="hierarchical")
    assert one == exchange_rows(num_experts=64, topk=8, ep=8, ranks_per_node=8, dispatcher="alltoall")


def _deepseek_remote_nodes():
    # top-8 of 256 experts, 32 per node on 8 nodes: a node is missed when all 8 picks fall among the other
    # 224 experts, drawn without replacement: prod_{i<8} (224 - i) / (256 - i)
    miss = math.prod((224 - i) / (256 - i) for i in range(8))
    return 7 * (1 - miss)


def test_deepseek_v3_rows():
    r = exchange_rows(num_experts=256, topk=8, ep=64, ranks_per_node=8, dispatcher="hierarchical")
    assert r.nic == pytest.approx(_deepseek_remote_nodes(), rel=1e-12)
    assert r.nic == pytest.approx(4.633, abs=1e-3)
    # a rank (4 experts) is missed with prod_{i<8} (252 - i)/(256 - i); 7 non-forwarders per node, 8 nodes
    assert r.nvlink == pytest.approx(56 * (1 - math.prod((252 - i) / (256 - i) for i in range(8))), rel=1e-12)
    # node-limited to 4 of 8 groups (one per node): the 8 picks among 4·32 experts
    lim = exchange_rows(
        num_experts=256, topk=8, ep=64, ranks_per_node=8, dispatcher="hierarchical", num_groups=8, group_topk=4
    )
    assert lim.nic == pytest.approx(7 / 8 * 4 * (1 - math.prod((96 - i) / (128 - i) for i in range(8))), rel=1e-12)


def test_hit_probability_without_limit_is_hypergeometric():
    assert hit_probability(num_experts=10, topk=2, unit=5) == pytest.approx(1 - (5 * 4) / (10 * 9))


def _ep_term(dispatcher, cfg, **kw):
    plan = Plan(
        tp=2, cp=1, pp=16, vpp=1, ep=64, etp=1, dp=32, edp=1, distributed_optimizer=True, recompute="selective",
        last_stage_layers=1, dispatcher=dispatcher, **kw,
    )  # fmt: skip
    shape = TrainingShape(seq_length=4096, global_batch_size=4096)
    cluster = Cluster(gpu=H100, num_gpus=1024)
    return _layer_times(cfg, plan, shape, cluster, 0.651, moe=True)["ep"]


def test_deepseek_v3_ep64_ep_term_falls_by_the_byte_factor():
    cfg = get_preset("deepseek_v3").replace(moe={"num_groups": None, "group_topk": None, "group_score_topk": None})
    a2a, hier = _ep_term("alltoall", cfg), _ep_term("hierarchical", cfg)
    # one row: the rank's 2048 tokens (4096 / TP2) x H 7168 in bf16
    row = 4096 / 2 * 7168 * 2
    nic_bw, nv_bw = 50e9 * 0.6, 450e9 * 0.6  # all-to-all reaches 60% of each link
    lat_ib, lat_nv = 40e-6, 20e-6
    # alltoall: 7 remote copies over the NIC, at the same time as 8·7/64 over NVLink (shorter)
    one_a2a = 7 * row / nic_bw + lat_ib
    # hierarchical: the distinct remote nodes over the NIC, then the forwarding hop over NVLink
    nvl = 56 * (1 - math.prod((252 - i) / (256 - i) for i in range(8)))
    one_hier = _deepseek_remote_nodes() * row / nic_bw + lat_ib + nvl * row / nv_bw + lat_nv
    assert hier / a2a == pytest.approx(one_hier / one_a2a, rel=1e-9)
    # the NIC bytes alone fall 1.51x; the forwarding hop takes some of it back
    assert 7 / _deepseek_remote_nodes() == pytest.approx(1.511, abs=1e-3)
    assert 1.25 < a2a / hier < 7 / _deepseek_remote_nodes()
    # node-limited (the preset's top-4 of 8 groups) sends fewer rows still
    assert _ep_term("hierarchical", get_preset("deepseek_v3")) < hier


def test_fp8_gemm_time_uses_the_fp8_peak():
    m = n = k = 8192
    bf16 = gemm_time(m, n, k, H100, 0.6)
    fp8 = gemm_time(m, n, k, H100, 0.6, dtype="fp8")
    assert bf16 / fp8 == pytest.approx(H100.fp8_flops / H100.bf16_flops)


def test_fp8_efficiency_reproduces_its_calibration_row():
    shape = TrainingShape(seq_length=4096, global_batch_size=256, fp8_recipe="delayed", fp8_dense=True)
    eff = calibrate_fp8_efficiency(
        get_preset("mixtral_8x22b"),
        cluster=Cluster(gpu=H100, num_gpus=128),
        shape=shape,
        mapping=dict(tp=2, cp=1, pp=8, ep=8, etp=1),
        target_tflops=631.7,
    )
    assert eff == pytest.approx(FP8_EFFICIENCY, abs=5e-4)


def test_fp8_experts_only_speed_up_the_expert_gemms():
    cfg = get_preset("deepseek_v3")
    cluster = Cluster(gpu=H100, num_gpus=1024)
    plan = Plan(
        tp=2, cp=1, pp=16, vpp=1, ep=64, etp=1, dp=32, edp=1, distributed_optimizer=True, recompute="selective",
        last_stage_layers=1,
    )  # fmt: skip
    times = {}
    for name, kw in (
        ("bf16", {}),
        ("exp", dict(fp8_recipe="blockwise")),
        ("all", dict(fp8_recipe="blockwise", fp8_dense=True)),
    ):
        shape = TrainingShape(seq_length=4096, global_batch_size=4096, **kw)
        times[name] = {m: _layer_times(cfg, plan, shape, cluster, 0.651, moe=m)["compute"] for m in (True, False)}
    assert times["exp"][False] == times["bf16"][False]  # a dense layer has no routed experts
    assert times["all"][False] < times["bf16"][False]
    assert times["all"][True] < times["exp"][True] < times["bf16"][True]


def test_dispatcher_choice():
    cfg = get_preset("deepseek_v3")
    assert planned_dispatcher(cfg) == "alltoall"  # the preset's moe.dispatcher
    assert planned_dispatcher(cfg, "hierarchical") == "hierarchical"
    with pytest.raises(ValueError, match="--dispatcher"):
        planned_dispatcher(cfg, "nccl")
    with pytest.raises(ValueError, match="--dispatcher"):
        exchange_rows(num_experts=8, topk=2, ep=8, ranks_per_node=4, dispatcher="flat")


def test_tool_refuses_fp8_dense_without_recipe(capsys):
    argv = ["--model", "mixtral_8x7b", "--world", "8", "--seq-length", "4096", "--global-batch-size", "8"]
    assert plan_tool.main(argv + ["--fp8-dense"]) == 2
    assert "--fp8-recipe" in capsys.readouterr().err


def test_dry_run_reads_the_dispatcher():
    from folding.launch.dry_run import dry_run_report
    from tests.unit.test_config_job import job

    hier = dry_run_report(job("recipes=deepseek_v3"), world_size=1024)
    # the recipe: EP16 = 2 nodes of 8, hierarchical: P(the other node is hit) remote rows
    assert "EP16 spans 2 nodes of 8 ranks" in hier and "0.96 rows across nodes" in hier and "(hierarchical)" in hier
    a2a = dry_run_report(job("recipes=deepseek_v3", "moe.dispatcher=alltoall"), world_size=1024)
    assert "4.00 rows across nodes, 3.50 inside a node (alltoall)" in a2a  # 8 copies, 8 of 15 peers remote


def test_benchmark_node_limited_routing_stays_on_m_nodes():
    import torch

    from benchmarks.bench_node_dispatch import route

    gen = torch.Generator().manual_seed(0)
    rmap, probs = route(512, 32, 8, 4, 2, gen)  # 4 nodes of 8 experts, at most 2 nodes per token
    nodes_hit = rmap.view(512, 4, 8).any(2).sum(1)
    assert (rmap.sum(1) == 8).all() and (nodes_hit <= 2).all() and (nodes_hit == 2).any()
    assert ((probs > 0) == rmap).all()
    free, _ = route(512, 32, 8, 4, None, gen)
    assert (free.view(512, 4, 8).any(2).sum(1) > 2).any()  # without the limit tokens reach more nodes
