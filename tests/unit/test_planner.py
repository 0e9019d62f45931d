"""The planner's memory model, step-time pieces and enumeration, against hand-worked values and oracles."""

import dataclasses
import itertools
import json
import subprocess
import sys

import pytest

from folding.model.presets import get_preset
from folding.moe.settings import LayerSettings
from folding.parallel import LayoutError, ParallelLayout
from folding.planning.costs import (
    _a2a_time,
    _exposed_behind_chunks,
    gemm_time,
    gemm_train_times,
    hidden_behind,
    wave_utilization,
)
from folding.planning.hardware import GIB, get_gpu
from folding.planning.planner import COMPUTE_EFFICIENCY, enumerate_plans, evaluate, plan_layouts, plan_memory
from folding.planning.step_time import (
    Cluster,
    Plan,
    TrainingShape,
    _layer_times,
    _tp_block,
    estimate_step_time,
    stage_parameters,
)

TINY = get_preset("mixtral_tiny")
SHAPE = TrainingShape(seq_length=16, global_batch_size=8)


def _plan(**kw):
    base = dict(tp=1, cp=1, pp=1, vpp=1, ep=1, etp=1, dp=1, edp=1, distributed_optimizer=True, recompute="none")
    base.update(kw)
    return Plan(**base)


def test_memory_by_hand_mixtral_tiny():
    # 8 GPUs: attention TP2 DP2 PP2, MoE ETP1 EP4 EDP1, distributed optimizer, no recompute, s=16, GBS 8
    # (4 micro-batches per replica).
    plan = _plan(tp=2, pp=2, ep=4, dp=2, edp=1)
    # Stage 0 parameters: per layer q,k,v,o = 64*64 + 2*64*32 + 64*64 = 12288 (TP-sharded), 2 norms of 64,
    # router 8*64; 2 layers per stage; embedding 512*64/2.  Experts: 2 layers * 8 * 3*64*96 / EP4.
    dense = 2 * (12288 / 2 + 2 * 64) + 2 * 8 * 64 + 512 * 64 / 2
    expert = 2 * 8 * 3 * 64 * 96 / 4
    assert stage_parameters(TINY, plan, last=False) == {"dense": dense, "expert": expert}
    assert (dense, expert) == (29952, 73728)
    # Activations per layer and micro-batch, bf16, T = 16/TP2 = 8 tokens, R = 8*k2 = 16 expert rows (bytes,
    # folding.planning.activations' terms): input and residual a*T*H = 1024 each; both norms' outputs
    # 2*a*T*H + fp32 rstd 8*T = 2112; attention a*T*(hd + 2gd + hd) + fp32 log-sum-exp 4*T*h = 3072 + 256;
    # router T*(fp32 logits 4E + aux softmax 4E + int64 top-k 8k + its softmax 4k) = 704; dispatch a*R*H +
    # fp32 probs 4R + int64 token and expert ids 16*T*k = 2368; experts 3*a*R*F (fc1's [R, 2F] output and
    # fc2's [R, F] input, kept by the fused weighted SwiGLU) = 9216.
    per_layer = 1024 + 1024 + 2112 + (3072 + 256) + 704 + 2368 + 9216
    assert per_layer == 19776
    rope = 2 * 2 * 16 * 8  # each chunk forward's cos/sin tables at s=16, d=8
    mem = plan_memory(TINY, plan, shape=SHAPE)
    router = 2 * 8 * 64  # fp32 whatever the parameter dtype: 4 bytes, no master copy
    # Stage 0 is the worse one: 1F1B keeps PP2 micro-batches of its 2 layers.
    assert mem.stage == 0
    assert mem.by_part() == {
        "params": (dense + expert) * 2 + router * 2,
        "grads": (dense + expert) * 4,
        # dense sharded over DP*CP=2, experts over EDP=1
        "optimizer": 12 * (dense / 2 + expert / 1) - 4 * router / 2,
        "activations": 2 * 2 * per_layer + 2 * rope,
        # the experts' backward working set 5*a*R*F = 5*2*16*96 = 15360 bytes (fc2's input gradient,
        # silu(gate), grad*up [R, F] each, fc1's output gradient [R, 2F]) outweighs the dispatcher's
        # permuted send buffer + receive + sorted copy a*T*k*H*3 = 2*8*2*64*3 = 6144 bytes
        "transient": 5 * 2 * 16 * 96,
    }
    # Without the distributed optimizer, with full recompute: the last stage is the larger one. It adds the
    # output layer (512*64/2) and final norm (64) to the parameters, keeps one micro-batch of layer inputs
    # (2 layers * a*T*H) and rope tables, the final norm's input and rstd (a*T*H + 4*T), the fused loss's bf16
    # input (16 gathered tokens * 64), one fp32 log-sum-exp and one int64 label per token and one chunk (all 16
    # tokens) of fp32 logits with their softmax (2 * 16 * 512/2 * 4 bytes), and re-materializes one whole layer
    # (all but its kept input) in backward, while the experts' backward working set is alive.
    mem2 = plan_memory(
        TINY, _plan(tp=2, pp=2, ep=4, dp=2, edp=1, distributed_optimizer=False, recompute="full"), shape=SHAPE
    )
    dense_last = dense - 512 * 64 / 2 + 512 * 64 / 2 + 64
    assert mem2.stage == 1
    assert mem2.optimizer_dense + mem2.optimizer_expert == 12 * (dense_last + expert) - 4 * router
    head = (2 * 8 * 64 + 4 * 8) + (2 * 16 * 64 + 4 * 16 + 8 * 16 + 2 * 16 * 256 * 4)
    assert mem2.activations == 2 * 2 * 8 * 64 + rope + head
    assert mem2.transient == 5 * 2 * 16 * 96 + per_layer - 1024  # experts' backward working set + one layer
    # A plain-autograd SwiGLU keeps 2 more F-wide bf16 tensors per expert row (R=16 rows, F=96), in each of the
    # 2 layers of the 2 micro-batches in flight.
    unfused = plan_memory(TINY, plan, shape=TrainingShape(seq_length=16, global_batch_size=8, fused_swiglu=False))
    assert unfused.activations - mem.activations == 2 * 2 * (2 * 2 * 16 * 96)


def test_expert_memory_falls_with_ep():
    shape = TrainingShape(seq_length=4096, global_batch_size=256)
    cfg = get_preset("mixtral_8x22b")
    a = plan_memory(cfg, _plan(tp=2, pp=8, ep=4, dp=8, edp=4), shape=shape).by_part()
    b = plan_memory(cfg, _plan(tp=2, pp=8, ep=8, dp=8, edp=2), shape=shape).by_part()
    assert b["params"] < a["params"] and b["grads"] < a["grads"]
    # With the distributed optimizer, expert optimizer state per GPU is total/world whatever EP
    # (docs/optimizer.md, the memory model).
    ea = stage_parameters(cfg, _plan(tp=2, pp=8, ep=4), last=False)["expert"] / 4
    eb = stage_parameters(cfg, _plan(tp=2, pp=8, ep=8), last=False)["expert"] / 2
    assert ea == pytest.approx(eb)


def test_activation_memory_shows_tp_and_recompute():
    # TP2 keeps twice the activations of TP4; the recompute modes drop what they checkpoint.
    shape = TrainingShape(seq_length=4096, global_batch_size=256)
    cfg = get_preset("mixtral_8x22b_g8t8")
    acts = {
        (tp, rc): plan_memory(cfg, _plan(tp=tp, pp=8, ep=8, dp=16 // tp, edp=2, recompute=rc), shape=shape).activations
        for tp in (2, 4)
        for rc in ("none", "selective", "moe", "full")
    }
    assert acts[(2, "none")] > 1.9 * acts[(4, "none")]
    for tp in (2, 4):
        assert acts[(tp, "full")] < acts[(tp, "moe")] < acts[(tp, "selective")] < acts[(tp, "none")]


def test_wave_utilization_by_hand():
    assert wave_utilization(128 * 132, 256, 132) == pytest.approx(1.0)  # exactly one wave of 128x256 tiles
    # 129 x 128: two 128x128 tiles, one wave; useful work = 129*128 / (128*128) tiles of 132 SM slots.
    assert wave_utilization(129, 128, 132) == pytest.approx(129 * 128 / 128 / 128 / 132)
    # A grouped GEMM of 133 experts of 128x256 each: 133 tiles of 128x256 need 2 waves of 132 SMs (50.4%),
    # 266 tiles of 128x128 need 3 (67.2%): the better one counts. Per expert, 133 GEMMs would pay 133 waves.
    assert wave_utilization(128, 256, 132, groups=133) == pytest.approx(266 / (3 * 132))
    assert wave_utilization(128, 256, 132, groups=132) == pytest.approx(1.0)


def test_gemm_roofline_by_hand():
    gpu = get_gpu("h100")
    hbm = 3.35e12 * 0.8  # achievable HBM bytes/s
    m, n = 128 * 132, 256  # exactly one wave of 128x256 tiles
    # k = 1: 2*m*n FLOPs are nothing; the bf16 operands (m*k + k*n) and output (m*n) make it HBM-bound.
    assert gemm_time(m, n, 1, gpu, 0.5) == pytest.approx(2 * (m + n + m * n) / hbm)
    # k = 8192: 70.9 GFLOP at half of 989.4 TFLOP/s = 143 us, against 289 MB of traffic = 108 us: compute-bound.
    assert gemm_time(m, n, 8192, gpu, 0.5) == pytest.approx(2 * m * n * 8192 / (0.5 * 989.4e12))
    # A fine-grained expert's wgrad (G8T8 at TP4 EP8: 1024 rows per expert, fc1 H=6144 -> 2F=4096) reduces over
    # the 1024 rows into an fp32 [6144, 4096] accumulator read and written (8 bytes per element): 201 MB + 21 MB
    # of operands = 83 us at 2.68 TB/s, longer than its 51.5 GFLOP at 0.68 of peak (77 us).
    fwd, dgrad, wgrad = gemm_train_times(1024, 4096, 6144, gpu, 0.68)
    assert wgrad == pytest.approx((2 * (6144 * 1024 + 1024 * 4096) + 8 * 6144 * 4096) / hbm)
    assert wgrad > 2 * 1024 * 4096 * 6144 / (0.68 * 989.4e12 * wave_utilization(6144, 4096, 132))
    assert fwd == pytest.approx(2 * 1024 * 4096 * 6144 / (0.68 * 989.4e12 * wave_utilization(1024, 4096, 132)))
    assert dgrad == pytest.approx(2 * 1024 * 4096 * 6144 / (0.68 * 989.4e12 * wave_utilization(1024, 6144, 132)))


def test_tp_collectives_by_hand():
    # Collectives of 1 s; column GEMM (fwd, dgrad, wgrad) = (1, 0.5, 2) s, row GEMM (1, 1, 1) s; contention 0.3.
    col, row = (1.0, 0.5, 2.0), (1.0, 1.0, 1.0)
    # Default (no userbuffers): forward all-gather + reduce-scatter and the backward all-gather of the output
    # gradient are exposed (3 s); the input re-gather outlasts the 0.5 s dgrad by 0.5 s and pays 0.3 * 0.5 for
    # the overlapped part; the reduce-scatter hides behind the 2 s wgrad and pays 0.3 * 1.
    assert _tp_block(1.0, 1, 4, col, row, False, 0.3) == pytest.approx(3 + 0.5 + 0.15 + 0.3)
    # Selective recompute runs the forward pair twice: 2 more seconds exposed.
    assert _tp_block(1.0, 2, 4, col, row, False, 0.3) == pytest.approx(5 + 0.5 + 0.15 + 0.3)
    # tp_comm_overlap: 5 collectives chunked behind 6.5 s of GEMMs, one chunk of 4 exposed (1.25 s) and the
    # hidden 3.75 s at 0.3.
    assert _tp_block(1.0, 1, 4, col, row, True, 0.3) == pytest.approx(1.25 + 0.3 * 3.75)
    assert hidden_behind(2.0, 0.5, 0.3) == pytest.approx(1.5 + 0.15)


def test_cp_all_gather_by_hand():
    # Mixtral-8x22B (8 KV heads of d=128), TP2 CP2: each rank computes K and V for 4096/2 = 2048 tokens of
    # 8/2 = 4 KV heads, 2048*4*128*2 B = 2 MiB each. Folding all-gathers K and V over CP (receiving the other
    # rank's 2 MiB, inside the NVLink domain at 80% of 450 GB/s, + 20 us) in forward and reduce-scatters dK and
    # dV in backward: 4 exposed collectives per layer and micro-batch. The sort of the gathered K/V (2 x 4 MiB)
    # into sequence order is 5 memory-bound passes (read+write forward, zeros + index_put + read backward).
    cfg, shape, gpu = (
        get_preset("mixtral_8x22b"),
        TrainingShape(seq_length=4096, global_batch_size=256),
        get_gpu("h100"),
    )
    cl = Cluster(gpu=gpu, num_gpus=128)
    kv = 2048 * 4 * 128 * 2
    want = 4 * (kv / (450e9 * 0.8) + 20e-6) + 5 * (2 * 2 * kv) / (gpu.hbm_bandwidth * gpu.hbm_efficiency)
    plan = _plan(tp=2, cp=2, pp=8, ep=8, dp=4, edp=2)
    assert _layer_times(cfg, plan, shape, cl, 0.6, True)["cp"] == pytest.approx(want)
    # full recompute repeats the forward all-gathers and the forward sort: 6 collectives, 7 passes
    full = dataclasses.replace(plan, recompute="full")
    want_full = 6 * (kv / (450e9 * 0.8) + 20e-6) + 7 * (2 * 2 * kv) / (gpu.hbm_bandwidth * gpu.hbm_efficiency)
    assert _layer_times(cfg, full, shape, cl, 0.6, True)["cp"] == pytest.approx(want_full)
    # selective (core_attn) checkpoints the kernel alone, after the gathers: none of them runs again
    sel = dataclasses.replace(plan, recompute="selective")
    assert _layer_times(cfg, sel, shape, cl, 0.6, True)["cp"] == pytest.approx(want)
    assert _layer_times(cfg, _plan(tp=2, pp=8, ep=8, dp=8, edp=2), shape, cl, 0.6, True)["cp"] == 0.0


def test_pipeline_sends_overlap_only_when_interleaved():
    cfg, shape = get_preset("mixtral_8x22b"), TrainingShape(seq_length=4096, global_batch_size=256)
    gpu = get_gpu("h100")
    cl = Cluster(gpu=gpu, num_gpus=128)  # 16 GPUs per stage: each send crosses nodes
    send = 2048 * 6144 * 2 / (50e9 * 0.8)  # [S/TP, H] bf16 over the NIC at 80%: 0.63 ms
    m = 256 // 8  # micro-batches per replica (DP8)
    t1 = estimate_step_time(
        cfg, _plan(tp=2, pp=8, vpp=1, ep=8, dp=8, edp=2), shape=shape, cluster=cl, compute_efficiency=0.6
    )
    # 1F1B waits for each send and receive: 2 per micro-batch, each the transfer plus the inter-node latency.
    assert t1.breakdown["pp"] == pytest.approx(m * 2 * (send + 40e-6))
    # Interleaved (overlap_p2p_comm): 2 per micro-batch and virtual stage, each hidden behind a chunk's compute
    # (tens of ms) but paying 30% contention, plus the latency.
    t7 = estimate_step_time(
        cfg, _plan(tp=2, pp=8, vpp=7, ep=8, dp=8, edp=2), shape=shape, cluster=cl, compute_efficiency=0.6
    )
    assert t7.breakdown["pp"] == pytest.approx(m * 2 * 7 * (0.3 * send + 40e-6))


def test_dp_overlap_per_model_chunk_by_hand():
    # 1F1B: 3 s of reduce-scatter overlap the last micro-batch's 1 s backward: 2 s exposed.
    assert _exposed_behind_chunks(3.0, pp=4, vpp=1, slot_s=1.0) == pytest.approx(2.0)
    # Interleaved, pp4 vpp2, 1 s chunk-backward slots, 2 s per chunk: chunk 1 may start 4*1+1 = 5 slots before
    # the end and ends at -3; chunk 0 starts with its last backward (-1) and ends at +1: 1 s exposed.
    assert _exposed_behind_chunks(4.0, pp=4, vpp=2, slot_s=1.0) == pytest.approx(1.0)
    # 10 s per chunk: chunk 1 runs -5..5, chunk 0 queues behind it until 15.
    assert _exposed_behind_chunks(20.0, pp=4, vpp=2, slot_s=1.0) == pytest.approx(15.0)
    assert _exposed_behind_chunks(0.5, pp=4, vpp=2, slot_s=1.0) == 0.0
    assert _exposed_behind_chunks(0.0, pp=4, vpp=1, slot_s=1.0) == 0.0


def test_param_all_gather_hides_only_behind_the_optimizer_step():
    # Folding waits for the distributed optimizer's bf16 parameter all-gather at the end of the step: only the
    # optimizer step (30 bytes per local shard element at 80% of HBM) hides it. The fp32 gradient reduce-scatter
    # overlaps the backward: between 30% (all hidden) and 100% of it is paid.
    cfg, shape, gpu = (
        get_preset("mixtral_8x22b"),
        TrainingShape(seq_length=4096, global_batch_size=256),
        get_gpu("h100"),
    )
    cl = Cluster(gpu=gpu, num_gpus=128)
    plan = _plan(tp=2, pp=8, vpp=7, ep=8, dp=8, edp=2)
    p = stage_parameters(cfg, plan, last=True)
    nic = 50e9 * 0.8  # DP (span 16) and EDP (span 16) groups cross nodes
    param_s = (7 / 8 * p["dense"] * 2 + 1 / 2 * p["expert"] * 2) / nic + 2 * 40e-6
    grad_s = (7 / 8 * p["dense"] * 4 + 1 / 2 * p["expert"] * 4) / nic + 2 * 40e-6
    opt = 30 * (p["dense"] / 8 + p["expert"] / 2) / (gpu.hbm_bandwidth * gpu.hbm_efficiency)
    t = estimate_step_time(cfg, plan, shape=shape, cluster=cl, compute_efficiency=0.6)
    assert t.breakdown["optimizer"] == pytest.approx(opt)
    gather = hidden_behind(param_s, opt, 0.3)
    assert gather > 0.05  # ~0.06 s: not hidden behind the next forward
    assert 0.3 * grad_s - 1e-9 <= t.breakdown["dp"] - gather <= grad_s + 1e-9


def test_a2a_splits_across_nodes():
    gpu = get_gpu("h100")
    cluster = Cluster(gpu=gpu, num_gpus=16)
    nv, ib = gpu.link_bandwidth(crosses_node=False, kind="a2a"), gpu.link_bandwidth(crosses_node=True, kind="a2a")
    # EP8 at stride 1: all peers inside the node.
    assert _a2a_time(1e9, 8, 1, cluster) == pytest.approx(1e9 / nv + gpu.intra_latency_s)
    # EP16 at stride 1: 7 of 15 peers on the node, 8 off it; the NIC share dominates.
    assert _a2a_time(1e9, 16, 1, cluster) == pytest.approx(1e9 * 8 / 15 / ib + gpu.inter_latency_s)
    # EP4 at stride 4 (non-folded TP2 CP2): 2 of the 4 ranks per node.
    assert _a2a_time(1e9, 4, 4, cluster) == pytest.approx(1e9 * 2 / 3 / ib + gpu.inter_latency_s)


def test_step_time_structure():
    cfg, shape = get_preset("mixtral_8x22b"), TrainingShape(seq_length=4096, global_batch_size=256)
    cl = Cluster(gpu=get_gpu("h100"), num_gpus=128)
    folded = _plan(tp=2, pp=8, vpp=1, ep=8, etp=1, dp=8, edp=2)
    t = estimate_step_time(cfg, folded, shape=shape, cluster=cl, compute_efficiency=0.5)
    assert t.step_s == pytest.approx(sum(t.breakdown.values()))
    # MFU is model FLOPs over time and peak.
    from folding.planning.flops import flops_per_token

    assert t.mfu == pytest.approx(flops_per_token(cfg, 4096).model_training * 256 * 4096 / (t.step_s * 128 * 989.4e12))
    # Interleaving shrinks the bubble; a higher efficiency shortens compute in proportion.
    t7 = estimate_step_time(
        cfg, _plan(tp=2, pp=8, vpp=7, ep=8, etp=1, dp=8, edp=2), shape=shape, cluster=cl, compute_efficiency=0.5
    )
    assert t7.breakdown["bubble"] < t.breakdown["bubble"] / 5
    t2 = estimate_step_time(cfg, folded, shape=shape, cluster=cl, compute_efficiency=1.0)
    assert t2.breakdown["compute"] == pytest.approx(t.breakdown["compute"] / 2, rel=0.01)  # + host syncs
    # Without folding (ETP=TP, dispatch over TP*EP = 16 ranks) the all-to-all leaves the node: slower.
    unfolded = _plan(tp=2, pp=8, ep=8, etp=2, dp=8, edp=1, folded=False)
    tu = estimate_step_time(cfg, unfolded, shape=shape, cluster=cl, compute_efficiency=0.5)
    assert tu.breakdown["ep"] > 3 * t.breakdown["ep"]
    # Full recompute costs an extra forward.
    tr = estimate_step_time(
        cfg, _plan(tp=2, pp=8, ep=8, dp=8, edp=2, recompute="full"), shape=shape, cluster=cl, compute_efficiency=0.5
    )
    assert tr.breakdown["compute"] == pytest.approx(t.breakdown["compute"] * 4 / 3, rel=0.05)
    with pytest.raises(ValueError, match="compute_efficiency"):
        estimate_step_time(cfg, folded, shape=shape, cluster=cl, compute_efficiency=0)


def test_enumeration_matches_oracle():
    """Every plan yielded is legal, and every legal mapping is yielded (brute force over all sizes)."""
    cl = Cluster(gpu=get_gpu("h100"), num_gpus=8)
    shape = TrainingShape(seq_length=16, global_batch_size=8)
    got = {(p.tp, p.cp, p.pp, p.vpp, p.ep, p.etp) for p in enumerate_plans(TINY, cluster=cl, shape=shape)}
    want = set()
    sizes = (1, 2, 4, 8)  # every size of a legal 8-rank layout divides 8 (vpp is free: 1..8)
    for tp, cp, pp, vpp, ep, etp in itertools.product(sizes, sizes, sizes, range(1, 9), sizes, sizes):
        try:
            lay = ParallelLayout(
                world_size=8, tp=tp, cp=cp, pp=pp, vpp=vpp if vpp > 1 else None, ep=ep, etp=etp, num_experts=8
            )
        except LayoutError:
            continue
        m = 8 // lay.dp if 8 % lay.dp == 0 else 0
        if 8 % tp or 4 % tp or 96 % etp or 4 % (pp * vpp) or 16 % (2 * cp) or not m or (vpp > 1 and m % pp):
            continue
        want.add((tp, cp, pp, vpp, ep, etp))
    assert got == want and len(got) > 50
    plans = list(enumerate_plans(TINY, cluster=cl, shape=shape))
    assert len(plans) == 8 * len(got)  # x distributed optimizer on/off x 4 recompute modes


def test_plan_layouts_sorted_distinct_and_fitting():
    cl = Cluster(gpu=get_gpu("h100"), num_gpus=8)
    res = plan_layouts(TINY, cluster=cl, shape=SHAPE)
    steps = [r.time.step_s for r in res]
    assert steps == sorted(steps)
    keys = [(r.plan.tp, r.plan.cp, r.plan.pp, r.plan.ep, r.plan.etp) for r in res]
    assert len(keys) == len(set(keys))
    every = plan_layouts(TINY, cluster=cl, shape=SHAPE, distinct=False)
    assert len(every) > len(res)
    assert every[0].time.step_s == res[0].time.step_s
    # A GPU too small for anything: nothing fits.
    tiny_gpu = get_gpu("h100").__class__(**{**get_gpu("h100").__dict__, "usable_memory_gib": 1e-4})
    assert plan_layouts(TINY, cluster=Cluster(gpu=tiny_gpu, num_gpus=8), shape=SHAPE) == []
    # The allocator overhead (5%) counts: a GPU 2% larger than the smallest estimate fits nothing.
    smallest = min(r.memory.total for r in every)
    snug = get_gpu("h100").__class__(**{**get_gpu("h100").__dict__, "usable_memory_gib": 1.02 * smallest / GIB})
    assert plan_layouts(TINY, cluster=Cluster(gpu=snug, num_gpus=8), shape=SHAPE) == []
    r = evaluate(TINY, res[0].plan, cluster=cl, shape=SHAPE)
    d = r.to_dict()
    assert {"tp", "cp", "pp", "vpp", "ep", "etp", "dp", "edp", "mfu", "memory_gib"} <= set(d)
    assert 0 < d["mfu"] < 1


def test_bad_input_names_the_setting():
    with pytest.raises(ValueError, match="--world"):
        plan_layouts(TINY, cluster=Cluster(gpu=get_gpu("h100"), num_gpus=12), shape=SHAPE)
    with pytest.raises(ValueError, match="--global-batch-size"):
        plan_layouts(
            TINY,
            cluster=Cluster(gpu=get_gpu("h100"), num_gpus=8),
            shape=TrainingShape(seq_length=16, global_batch_size=0),
        )
    with pytest.raises(ValueError, match="--gpu 'a100'"):
        get_gpu("a100")


def test_tool_json_only_on_stdout():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.plan",
            "--model",
            "mixtral_8x7b",
            "--world",
            "8",
            "--gpu",
            "b200",
            "--seq-length",
            "4096",
            "--global-batch-size",
            "8",
            "--json",
            "--fused-swiglu",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = json.loads(out.stdout)
    assert rows and rows[0]["mfu"] >= rows[-1]["mfu"]
    assert set(rows[0]["memory_breakdown_gib"]) == {"params", "grads", "optimizer", "activations", "transient"}
    # --fused-swiglu (the default, still accepted) plans the engine's experts: the best layout keeps fewer expert
    # activations than a plain-autograd SwiGLU would.
    best = rows[0]
    plan = Plan(
        **{
            k: best[k]
            for k in ("tp", "cp", "pp", "vpp", "ep", "etp", "dp", "edp", "distributed_optimizer", "recompute")
        }
    )
    unfused = plan_memory(
        get_preset("mixtral_8x7b"), plan, shape=TrainingShape(seq_length=4096, global_batch_size=8, fused_swiglu=False)
    )
    assert best["memory_breakdown_gib"]["activations"] < unfused.activations / GIB - 1
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.plan",
            "--model",
            "mixtral_tiny",
            "--gpus",
            "8",
            "--gpu",
            "v100",
            "--seq-length",
            "16",
            "--global-batch-size",
            "8",
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--gpu" in bad.stderr and bad.stdout == ""


def test_constant_is_in_range():
    assert 0.3 < COMPUTE_EFFICIENCY < 0.9


def test_tool_moe_options_reach_the_planner():
    def best_step(*extra):
        args = ["--model", "mixtral_8x7b", "--world", "8", "--gpu", "b200", "--seq-length", "4096"]
        args += ["--global-batch-size", "8"]
        out = subprocess.run(
            [sys.executable, "-m", "tools.plan", *args, "--json", *extra], capture_output=True, text=True, check=True
        )
        return json.loads(out.stdout)[0]["step_s"]

    assert best_step("--moe", "topk=1", "--moe", "pre_softmax=true") < best_step()  # top-1: half the expert work
    bad = subprocess.run(
        [sys.executable, "-m", "tools.plan", "--model", "mixtral_8x7b", "--world", "8", "--seq-length", "8"]
        + ["--global-batch-size", "8", "--moe", "top_k=1"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "unknown MoE option(s) ['top_k']" in bad.stderr


def test_deepseek_v3_mla_memory_and_uneven_pipeline():
    """MLA's replicated down-projections and latent norms and its TP-sharded up-projections are counted
    like the model holds them; 61 layers on PP16 plan as 15 stages of 4 and a last stage of 1."""
    from folding.model.transformer import MoETransformer
    from folding.planning.memory import param_counts

    cfg = get_preset("deepseek_v3_tiny")
    # the rank's attention parameters under TP2 (less the layer's input norm): replicated + its half of the heads'
    rep = cfg.mla.replicated_params(hidden_size=cfg.hidden_size)
    sharded = cfg.attention_params(tp=2) - cfg.hidden_size - rep
    model = MoETransformer(cfg, settings=LayerSettings(device="meta"))
    attn = model.layers["0"].attention
    want_rep = sum(
        p.numel()
        for n, p in attn.named_parameters()
        if n.split(".")[0] in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")
    )
    want_sharded = sum(
        p.numel() for n, p in attn.named_parameters() if n.split(".")[0] in ("q_b_proj", "kv_b_proj", "o_proj")
    )
    assert (rep, sharded) == (want_rep, want_sharded // 2)
    big = get_preset("deepseek_v3")
    cluster = Cluster(gpu=get_gpu("h100"), num_gpus=64)
    shape = TrainingShape(seq_length=4096, global_batch_size=64)
    plans = [p for p in enumerate_plans(big, cluster=cluster, shape=shape) if p.pp == 16]
    assert plans and all(p.last_stage_layers == 1 and p.vpp == 1 for p in plans)
    p16 = plans[0]
    first, last = stage_parameters(big, p16, last=False), stage_parameters(big, p16, last=True)
    middle = param_counts(big, p16, stage=1)
    # stage 0: layers 0-3 (3 dense, 1 MoE); stages 1-14: 4 MoE layers each; stage 15: layer 60 (MoE) and the
    # multi-token-prediction module's layer (number 61, MoE)
    assert 2 * first["expert"] == last["expert"] and middle.expert == 4 * first["expert"] > 0


def test_mtp_work_on_the_last_stage_by_hand():
    """deepseek_v3_tiny (4 layers, one MTP module, MoE layer 4) on PP2 (2 + 2 layers): the last stage, the
    slower, runs per micro-batch one more MoE layer, the module's [T, 2H] x [2H, H] projection and one more
    output layer + cross-entropy than without MTP."""
    from folding.planning.step_time import _last_stage_extra

    cfg = get_preset("deepseek_v3_tiny")
    base = cfg.replace(mtp_num_layers=0)
    cl = Cluster(gpu=get_gpu("h100"), num_gpus=4)
    plan = _plan(tp=2, pp=2, ep=2, dp=1, edp=1, recompute="selective")
    eff = 0.6
    t, t0 = (estimate_step_time(c, plan, shape=SHAPE, cluster=cl, compute_efficiency=eff) for c in (cfg, base))
    moe_l = _layer_times(cfg, plan, SHAPE, cl, eff, moe=True)
    gpu, tok, m = cl.gpu, 16 / 2, 8  # 16 tokens over TP2; 8 micro-batches
    proj = sum(gemm_train_times(tok, 64, 128, gpu, eff))
    out = sum(gemm_train_times(16, 512 / 2, 64, gpu, eff))
    assert t.breakdown["compute"] - t0.breakdown["compute"] == pytest.approx(m * (moe_l["compute"] + proj + out))
    assert t.breakdown["ep"] - t0.breakdown["ep"] == pytest.approx(m * moe_l["ep"])
    extra = _last_stage_extra(cfg, plan, SHAPE, cl, eff, moe_l, _layer_times(cfg, plan, SHAPE, cl, eff, moe=False))
    assert extra["compute"] == pytest.approx(moe_l["compute"] + proj + 2 * out)
    # the bubble is (PP-1) mean stage times: half of the added work
    assert t.breakdown["bubble"] - t0.breakdown["bubble"] == pytest.approx(
        sum(extra.values()) / 2 - sum(_last_stage_extra(base, plan, SHAPE, cl, eff, moe_l, moe_l).values()) / 2
    )
    assert t.mfu != t0.mfu


def test_uneven_pipeline_runs_at_the_slowest_stage():
    """DeepSeek-V3 on PP16 with a 1-layer last stage: a stage of 4 MoE layers is slower than the last stage's
    1 layer + MTP layer + 2 output layers, so the per-micro-batch work is the same with or without MTP; only the
    bubble (mean stage time) grows."""
    cfg = get_preset("deepseek_v3")
    cl = Cluster(gpu=get_gpu("h100"), num_gpus=1024)
    shape = TrainingShape(seq_length=4096, global_batch_size=4096)
    plan = _plan(tp=2, pp=16, ep=64, dp=32, edp=1, recompute="selective", last_stage_layers=1)
    t, t0 = (
        estimate_step_time(c, plan, shape=shape, cluster=cl, compute_efficiency=0.6)
        for c in (cfg, cfg.replace(mtp_num_layers=0))
    )
    for cause in ("compute", "memory_bound", "tp", "ep", "pp", "dp"):
        assert t.breakdown[cause] == pytest.approx(t0.breakdown[cause]), cause
    assert t.breakdown["bubble"] > t0.breakdown["bubble"]
    # with an even split (PP1: one stage) the module's work adds to the step
    one = _plan(tp=8, pp=1, ep=64, dp=128, edp=16, recompute="full")
    assert (
        estimate_step_time(cfg, one, shape=shape, cluster=cl, compute_efficiency=0.6).breakdown["compute"]
        > estimate_step_time(
            cfg.replace(mtp_num_layers=0), one, shape=shape, cluster=cl, compute_efficiency=0.6
        ).breakdown["compute"]
    )


def test_deepseek_v3_plans_count_mtp():
    """The planner ranks DeepSeek-V3 layouts (256 H100) with its MTP module on the last stage: that stage's
    memory grows with it (parameters, gradients, optimizer state and activations), the other stages' does not."""
    cfg = get_preset("deepseek_v3")
    cl = Cluster(gpu=get_gpu("h100"), num_gpus=256)
    shape = TrainingShape(seq_length=4096, global_batch_size=256)
    res = plan_layouts(cfg, cluster=cl, shape=shape)
    assert len(res) > 10 and [r.time.step_s for r in res] == sorted(r.time.step_s for r in res)
    best = res[0].plan
    from folding.planning.memory import memory_per_rank

    kw = dict(param_bytes=2, distributed=best.distributed_optimizer, recompute=best.recompute, seq_length=4096)
    kw.update(num_microbatches=256 // best.dp)
    base = cfg.replace(mtp_num_layers=0)
    last = {c: memory_per_rank(c, best, stage=best.pp - 1, **kw) for c in (cfg, base)}
    for part in ("params", "grads", "optimizer", "activations"):
        assert last[cfg].by_part()[part] > last[base].by_part()[part], part
    assert memory_per_rank(cfg, best, stage=0, **kw) == memory_per_rank(base, best, stage=0, **kw)


def test_uneven_splits_by_hand():
    """When PP does not divide the layers the planner proposes the last stage taking the remainder of
    ceil(L/PP)-layer stages and, with PP > 2, equal lighter first and last stages: the largest count that
    leaves the stages between an equal, larger share. Nothing when PP divides the layers."""
    from folding.planning.planner import _uneven_splits

    assert _uneven_splits(94, 16) == [(None, 4), (5, 5)]  # 15 x 6 + 4; 5 + 14 x 6 + 5
    assert _uneven_splits(61, 16) == [(None, 1)]  # 15 x 4 + 1; 61 - 2e is odd, never a multiple of 14
    assert _uneven_splits(10, 3) == [(None, 2), (3, 3)]  # 4 + 4 + 2; 3 + 4 + 3
    assert _uneven_splits(7, 2) == [(None, 3)]  # 4 + 3; no stage between
    assert _uneven_splits(32, 4) == [] and _uneven_splits(5, 1) == []


def test_planner_proposes_the_published_qwen3_235b_split():
    """Qwen3-235B-A22B (94 layers) on 256 H100 with Megatron-Bridge's mapping TP4 CP2 PP16 EP8 ETP1: both
    splits run 6-layer stages as the slowest (the last stage's 4 or 5 layers plus the output layer stay
    lighter), so they predict the same step time; 5 + 14 x 6 + 5 holds one layer fewer on the first stage,
    the one with the most micro-batches in flight, and the planner keeps it, as the recipe does."""
    cfg = get_preset("qwen3_235b_a22b")
    cl = Cluster(gpu=get_gpu("h100"), num_gpus=256)
    shape = TrainingShape(seq_length=4096, global_batch_size=256)
    base = dict(tp=4, cp=2, pp=16, ep=8, etp=1, dp=2, edp=2, recompute="none")
    last_only, both = (
        evaluate(cfg, _plan(**base, **ends), cluster=cl, shape=shape)
        for ends in (dict(last_stage_layers=4), dict(first_stage_layers=5, last_stage_layers=5))
    )
    assert both.time.step_s == pytest.approx(last_only.time.step_s, rel=1e-9)
    assert both.memory.total < last_only.memory.total
    kept = [
        r.plan
        for r in plan_layouts(cfg, cluster=cl, shape=shape)
        if (r.plan.tp, r.plan.cp, r.plan.pp, r.plan.ep, r.plan.etp) == (4, 2, 16, 8, 1)
    ]
    assert len(kept) == 1 and (kept[0].first_stage_layers, kept[0].last_stage_layers) == (5, 5)


def test_a_heavier_first_stage_sets_the_pace():
    """94 MoE layers on PP16 as 19 + 15 x 5: the first stage is the slowest, so per micro-batch the step runs
    19 layers' compute (the last stage's 5 layers and output layer are less)."""
    cfg = get_preset("qwen3_235b_a22b")
    cl = Cluster(gpu=get_gpu("h100"), num_gpus=256)
    shape = TrainingShape(seq_length=4096, global_batch_size=256)
    plan = _plan(tp=4, cp=2, pp=16, ep=8, etp=1, dp=2, edp=2, recompute="none", first_stage_layers=19)
    t = estimate_step_time(cfg, plan, shape=shape, cluster=cl, compute_efficiency=0.6)
    moe_l = _layer_times(cfg, plan, shape, cl, 0.6, moe=True)
    m = 256 // 2
    assert cfg.num_moe_layers() == 94
    assert t.breakdown["compute"] == pytest.approx(m * 19 * moe_l["compute"])
    assert t.breakdown["ep"] == pytest.approx(m * 19 * moe_l["ep"])
