"""Uneven virtual stages from ``parallel.pipeline_layout`` in the memory model, the step-time model, the planner
and the dry run: each reads the layers every pipeline rank's stages hold, a stage without transformer layers
counting none, and the recipes with Megatron-Bridge's H100 layouts print them stage by stage."""

import pytest

from folding.launch.dry_run import dry_run_report
from folding.model.presets import get_preset
from folding.model.transformer import MoETransformer
from folding.moe.settings import LayerSettings
from folding.parallel import ParallelLayout
from folding.parallel.params import param_spec
from folding.parallel.partition import partition_layers
from folding.planning.activations import (
    activation_bytes_per_layer,
    in_flight_chunks,
    logits_bytes,
    mtp_activation_bytes,
    rope_bytes,
)
from folding.planning.hardware import get_gpu
from folding.planning.memory import memory_per_rank, param_counts, peak_candidate_stages, stage_layers
from folding.planning.planner import _layout_variants, describe_plan, enumerate_plans, plan_memory, plan_overrides
from folding.planning.step_time import (
    Cluster,
    Plan,
    TrainingShape,
    _last_stage_extra,
    _layer_times,
    estimate_step_time,
    rank_layer_counts,
)
from tests.unit.test_config_job import job

DEEPSEEK = "Et|(tt|)*30mL"
TINY = "Et||ttt|mL"  # deepseek_v3_tiny on PP2: rank 0 all four layers, rank 1 an empty stage and MTP + loss


def _built(cfg, ranges, v, V):
    """(dense, expert) elements of virtual stage ``v`` of ``V`` built on the meta device."""
    model = MoETransformer(
        cfg, settings=LayerSettings(device="meta"), layer_range=ranges[v], pre_process=v == 0, post_process=v == V - 1
    )
    out = [0, 0]
    for p in model.parameters():
        out[param_spec(p).expert] += p.numel()
    return out


def test_memory_model_counts_what_the_stages_build():
    """deepseek_v3_tiny (4 layers, layer 0 dense, one MTP module) under ``Et||ttt|mL``: rank 0 holds all four
    decoder layers and the embedding, rank 1 no decoder layer, only the final norm, the output layer, the MTP
    module and its embedding copy; the memory model's counts are the built stages', summed per rank."""
    cfg = get_preset("deepseek_v3_tiny")
    lay = ParallelLayout(world_size=2, pp=2, pipeline_layout=TINY)
    ranges = partition_layers(num_layers=4, pp=2, pipeline_layout=TINY, mtp_num_layers=1)
    assert ranges == [(0, 1), (1, 1), (1, 4), (4, 4)]
    assert stage_layers(cfg, lay, 0) == [0, 1, 2, 3] and stage_layers(cfg, lay, 1) == []
    for r in range(2):
        built = [sum(x) for x in zip(*(_built(cfg, ranges, v, 4) for v in (r, r + 2)))]
        c = param_counts(cfg, lay, stage=r)
        assert [c.dense, c.expert] == built, r
    even = ParallelLayout(world_size=2, pp=2, vpp=2)  # one layer per virtual stage: layers {0, 2} and {1, 3}
    assert param_counts(cfg, lay, stage=0).expert == 3 * param_counts(cfg, even, stage=0).expert  # 3 MoE vs 1
    assert param_counts(cfg, lay, stage=1).expert == param_counts(cfg, even, stage=1).expert // 3  # MTP's only


def test_memory_model_activations_follow_the_layers_per_rank():
    """Activations per rank: its layers' per-micro-batch bytes times the chunk forwards in flight over VPP.
    Against the even VPP2 split of the same model, rank 0 keeps two more MoE layers; rank 1 keeps no decoder
    layer, only the fused loss's logits chunk, the MTP module's activations and its chunk's RoPE tables."""
    cfg = get_preset("deepseek_v3_tiny")
    lay = ParallelLayout(world_size=2, pp=2, pipeline_layout=TINY)
    even = ParallelLayout(world_size=2, pp=2, vpp=2)
    kw = dict(seq_length=16, micro_batch_size=2, num_microbatches=4, recompute="none")
    act = dict(seq_length=16, micro_batch_size=2, recompute="none", act_bytes=2, fused_swiglu=True)
    moe = activation_bytes_per_layer(cfg, lay, moe_layer=True, **act)
    flight = in_flight_chunks(pp=2, vpp=2, stage=0, num_microbatches=4)
    got = memory_per_rank(cfg, lay, stage=0, **kw).activations - memory_per_rank(cfg, even, stage=0, **kw).activations
    assert got == int(2 * moe * flight / 2)
    last = memory_per_rank(cfg, lay, stage=1, **kw).activations
    # the RoPE tables of the one chunk of the two that runs layers (the MTP module's), averaged over the
    # rank's chunk forwards in flight like the layers' bytes
    rope = rope_bytes(cfg, lay, seq_length=16) * 1 * in_flight_chunks(pp=2, vpp=2, stage=1, num_microbatches=4) / 2
    assert last == int(
        logits_bytes(cfg, lay, seq_length=16, micro_batch_size=2) + mtp_activation_bytes(cfg, lay, **act) + rope
    )


def test_peak_candidates_under_the_deepseek_v3_layout():
    """Et|(tt|)*30mL on PP8: rank 0 holds 7 layers (layer 0 dense), rank 1 8 (layers 1 and 2 dense), ranks 2-6
    8 MoE layers, rank 7 6 and the MTP module. The candidates (0, 1, 2, 7) hold the worst stage."""
    cfg = get_preset("deepseek_v3")
    lay = ParallelLayout(world_size=1024, tp=2, pp=8, ep=64, etp=1, pipeline_layout=DEEPSEEK)
    assert [len(stage_layers(cfg, lay, r)) for r in range(8)] == [7, 8, 8, 8, 8, 8, 8, 6]
    # virtual stage v on rank v % 8: rank 0 stages 0, 8, 16, 24; rank 7 stages 7, 15, 23 and 31 (mL)
    assert stage_layers(cfg, lay, 0) == [0, 15, 16, 31, 32, 47, 48]
    assert stage_layers(cfg, lay, 7) == [13, 14, 29, 30, 45, 46]
    assert peak_candidate_stages(cfg, lay) == [0, 1, 2, 7]
    kw = dict(distributed=True, recompute="selective", seq_length=4096, num_microbatches=128)
    worst = max((memory_per_rank(cfg, lay, stage=k, **kw) for k in range(8)), key=lambda e: e.total)
    assert memory_per_rank(cfg, lay, **kw) == worst and worst.stage in (0, 1, 2, 7)
    per_layer = cfg.routed_experts_params(ep=64, etp=1)
    assert [param_counts(cfg, lay, stage=r).expert // per_layer for r in (0, 1, 2, 7)] == [6, 6, 8, 7]


def _plan(**kw):
    base = dict(tp=1, cp=1, pp=1, vpp=1, ep=1, etp=1, dp=1, edp=1, distributed_optimizer=True, recompute="none")
    return Plan(**{**base, **kw})


def test_step_time_runs_at_the_heaviest_rank_of_the_layout():
    """Qwen3-235B-A22B (94 MoE layers) on PP8 VPP2 with rank 0 holding 10 + 10 layers, ranks 1-6 5 + 5 and
    rank 7 5 + 9 (and the output layer): per micro-batch the step runs rank 0's 20 layers."""
    cfg = get_preset("qwen3_235b_a22b")
    layout = "Et*10|(t*5|)*7t*10|(t*5|)*6t*9L"
    cl = Cluster(gpu=get_gpu("h100"), num_gpus=256)
    shape = TrainingShape(seq_length=4096, global_batch_size=256)
    plan = _plan(tp=4, cp=2, pp=8, vpp=2, ep=8, etp=1, dp=4, edp=4, pipeline_layout=layout)
    assert rank_layer_counts(cfg, plan) == [20.0] + [10.0] * 6 + [14.0]
    t = estimate_step_time(cfg, plan, shape=shape, cluster=cl, compute_efficiency=0.6)
    moe_l = _layer_times(cfg, plan, shape, cl, 0.6, moe=True)
    m = 256 // 4
    assert t.breakdown["compute"] == pytest.approx(m * 20 * moe_l["compute"])
    assert t.breakdown["ep"] == pytest.approx(m * 20 * moe_l["ep"])
    # the same stages without the layout's skew (94 layers can't split evenly over 16: a layout with 6 per
    # stage but rank 0 lighter) run faster
    flat = "Et*4|(t*6|)*14t*6L"  # 4 + 84 + 6 = 94; rank 0: 4 + 6, ranks 1-6: 12, rank 7: 12 and the output
    fast = estimate_step_time(
        cfg, _plan(**{**vars(plan), "pipeline_layout": flat}), shape=shape, cluster=cl, compute_efficiency=0.6
    )
    assert fast.breakdown["compute"] < t.breakdown["compute"]


def test_step_time_with_a_stage_without_layers():
    """deepseek_v3_tiny under Et||ttt|mL: rank 0 runs the four decoder layers (the mean layer: layer 0 dense),
    rank 1 none, only the MTP module's layer, its projection and two output layers; against the even VPP2
    split (two layers each) the step runs at the slower rank of each."""
    cfg = get_preset("deepseek_v3_tiny")
    plan = _plan(pp=2, vpp=2, dp=1, edp=1, pipeline_layout=TINY)
    even = _plan(pp=2, vpp=2, dp=1, edp=1)
    assert rank_layer_counts(cfg, plan) == [4.0, 0.0] and rank_layer_counts(cfg, even) == [2.0, 2.0]
    cl, shape = Cluster(gpu=get_gpu("h100"), num_gpus=2), TrainingShape(seq_length=16, global_batch_size=8)
    moe_l, dense_l = (_layer_times(cfg, plan, shape, cl, 0.6, moe=moe) for moe in (True, False))
    causes = ("compute", "memory_bound", "tp", "cp", "ep")
    mean = {c: (3 * moe_l[c] + dense_l[c]) / 4 for c in causes}
    heads = _last_stage_extra(cfg, plan, shape, cl, 0.6, moe_l, dense_l)
    for p, (first, last) in ((plan, (4, 0)), (even, (2, 2))):
        ranks = [{c: first * mean[c] for c in causes}, {c: last * mean[c] + heads[c] for c in causes}]
        slowest = max(ranks, key=lambda d: sum(d.values()))  # the p2p term is the same on both
        t = estimate_step_time(cfg, p, shape=shape, cluster=cl, compute_efficiency=0.6)
        assert t.breakdown["compute"] == pytest.approx(8 * slowest["compute"])  # 8 micro-batches


def test_planner_proposes_and_runs_the_deepseek_v3_layout():
    """With ``pipeline_layouts`` the planner proposes, for PP·VPP stages that do not divide the layers, the
    balanced layout (Megatron-Bridge's Et|(tt|)*30mL on PP8 VPP4 for DeepSeek-V3); its plan prints the layout,
    its overrides carry it (quoted for Hydra) and compose into a job that validates on 1,024 ranks."""
    cfg = get_preset("deepseek_v3")
    assert ((None, None, DEEPSEEK), 4) in _layout_variants(cfg, 8)
    assert all(cfg.num_layers % (8 * vpp) for _, vpp in _layout_variants(cfg, 8))
    plan = _plan(tp=2, pp=8, vpp=4, ep=64, dp=64, edp=2, recompute="selective", pipeline_layout=DEEPSEEK)
    assert "PP8 VPP4 (layout Et|(tt|)*30mL)" in describe_plan(plan)
    over = plan_overrides(plan)
    assert "parallel.pipeline_layout='Et|(tt|)*30mL'" in over and "parallel.vpp=4" in over
    j = job(
        "model=deepseek_v3", *over, "parallel.world_size=1024", "train.global_batch_size=8192", "train.seq_length=4096"
    )
    from folding.job.validate import validate_job

    assert validate_job(j, world_size=1024).pipeline_layout == DEEPSEEK
    shape = TrainingShape(seq_length=4096, global_batch_size=8192)
    mem = plan_memory(cfg, plan, shape=shape)
    kw = dict(param_bytes=2, distributed=True, recompute="selective", seq_length=4096, num_microbatches=128)
    assert mem.total == max(memory_per_rank(cfg, plan, stage=k, **kw).total for k in range(8))


def test_planner_layouts_are_opt_in():
    """A 6-layer model on 8 GPUs: PP2 VPP2 (4 stages) and PP2 VPP4 / PP4 VPP2 (8 stages) do not divide 6 layers,
    their balanced layouts do ((6 + 2) / 4 = 2: Et|(tt|)*2tL; (6 + 2) / 8 = 1); only with ``pipeline_layouts``."""
    cfg = get_preset("mixtral_tiny", num_layers=6)
    cl, shape = Cluster(gpu=get_gpu("h100"), num_gpus=8), TrainingShape(seq_length=64, global_batch_size=64)
    plain = list(enumerate_plans(cfg, cluster=cl, shape=shape))
    more = list(enumerate_plans(cfg, cluster=cl, shape=shape, pipeline_layouts=True))
    assert all(p.pipeline_layout is None for p in plain)
    added = {(p.pp, p.vpp, p.pipeline_layout) for p in more if p.pipeline_layout}
    assert added == {(2, 2, "Et|(tt|)*2tL"), (2, 4, "E|(t|)*6L"), (4, 2, "E|(t|)*6L")}
    assert len(more) > len(plain) and set(plain) <= set(more)


@pytest.mark.parametrize(
    "recipe,world,rows",
    [
        (
            "deepseek_v3_pp8_vpp4",
            1024,
            {0: "Et|tt|tt|tt: 7 layers", 3: "tt|tt|tt|tt: 8 layers", 7: "tt|tt|tt|mL: 6 layers"},
        ),
        (
            "qwen3_235b_a22b_pp8_vpp4",
            256,
            {0: "Ett|ttt|ttt|ttt: 11 layers", 1: "ttt|ttt|ttt|ttt: 12 layers", 7: "ttt|ttt|ttt|ttL: 11 layers"},
        ),
    ],
)
def test_recipes_print_the_layout_stage_by_stage(recipe, world, rows):
    report = dry_run_report(job(f"recipes={recipe}"), world_size=world)
    lines = {int(ln.split()[1]): ln for ln in report.splitlines() if ln.startswith("  stage ")}
    assert sorted(lines) == list(range(8))
    for r, want in rows.items():
        assert f"  {want}  " in lines[r], lines[r]
