"""``parallel.overlap_moe_comm`` in the planner: the hidden MoE exchanges (bounded by the compute they hide
behind), the paired share of each pipeline rank, the extra activations in flight, the tool and the dry run."""

import dataclasses
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from folding.job.config import job_config_from_dict
from folding.job.schema import register_schema
from folding.launch.dry_run import memory_estimate
from folding.model.presets import get_preset
from folding.planning.activations import activation_bytes_per_layer, in_flight_chunks, rope_bytes
from folding.planning.hardware import get_gpu
from folding.planning.memory import memory_per_rank
from folding.planning.moe_overlap import (
    MoEPieces,
    exposed_exchanges,
    memory_with_overlap,
    overlap_activation_bytes,
    paired_share,
)
from folding.planning.planner import evaluate, plan_memory
from folding.planning.step_time import Cluster, Plan, TrainingShape, _layer_times, estimate_step_time

MIXTRAL = get_preset("mixtral_8x22b")
SHAPE = TrainingShape(seq_length=4096, global_batch_size=256)
CLUSTER = Cluster(gpu=get_gpu("h100"), num_gpus=128)
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _plan(**kw):
    base = dict(tp=2, cp=1, pp=8, vpp=1, ep=8, etp=1, dp=8, edp=2, distributed_optimizer=True, recompute="none")
    base.update(kw)
    return Plan(**base)


def test_exposed_exchanges_by_hand():
    c = 0.3
    # Every exchange (3) outlasts the compute it hides behind (1): 2 exposed + 0.3 of the hidden 1, per slot.
    ones = MoEPieces(attention_fwd=1, attention_bwd=1, experts_fwd=1, experts_dgrad=0.5, experts_wgrad=0.5)
    unpaired, paired = exposed_exchanges(3.0, ones, forwards=1, contention=c)
    assert unpaired == pytest.approx(12.0)  # no shared expert: nothing hides an unpaired exchange
    assert paired == pytest.approx(4 * (2 + c * 1))
    # Compute longer than every exchange: only the contention is paid.
    long = MoEPieces(attention_fwd=5, attention_bwd=5, experts_fwd=5, experts_dgrad=3, experts_wgrad=2)
    assert exposed_exchanges(1.0, long, forwards=1, contention=c)[1] == pytest.approx(4 * c)
    # Recompute of the MoE sublayer: the recomputed combine joins the backward combine behind A's attention.
    _, paired = exposed_exchanges(1.0, dataclasses.replace(long, attention_fwd=1.5), forwards=2, contention=c)
    assert paired == pytest.approx(c + c + (0.5 + c * 1.5) + 2 * c)
    # The shared expert hides its own dispatch, paired or not.
    shared = dataclasses.replace(ones, shared_fwd=2.0)
    assert exposed_exchanges(3.0, shared, forwards=1, contention=c)[0] == pytest.approx(12 - 3 + (1 + c * 2))
    # delay_wgrad moves the expert wgrad from behind A's dispatch to behind B's backward dispatch.
    p = MoEPieces(attention_fwd=9, attention_bwd=9, experts_fwd=0.5, experts_dgrad=4, experts_wgrad=2)
    kept = exposed_exchanges(3.0, p, forwards=1, contention=c)[1]
    delayed = exposed_exchanges(3.0, p, forwards=1, contention=c, delay_wgrad=True)[1]
    assert kept == pytest.approx(3 * c * 3 + (2.5 + c * 0.5))
    assert delayed == pytest.approx(3 * c * 3 + (0.5 + c * 2.5))
    # ... and the attention's wgrad from behind A's combine to behind B's backward combine (the deferred
    # work runs at B's next exchange): A's attention forward (1) alone left B's combine 2 exposed
    q = MoEPieces(attention_fwd=1, attention_bwd=5, experts_fwd=5, experts_dgrad=5, experts_wgrad=0, attention_wgrad=2)
    kept = exposed_exchanges(3.0, q, forwards=1, contention=c)[1]
    delayed = exposed_exchanges(3.0, q, forwards=1, contention=c, delay_wgrad=True)[1]
    assert kept == pytest.approx(3 * c * 3 + (2 + c * 1))
    assert delayed == pytest.approx(c * 3 + c * 3 + (0 + c * 3) + c * 3)


def test_paired_share_by_schedule():
    # No pipelining: the first forward and the last backward run alone.
    assert paired_share(pp=1, vpp=1, stage=0, num_microbatches=4) == pytest.approx(3 / 4)
    assert paired_share(pp=1, vpp=1, stage=0, num_microbatches=1) == 0
    # 1F1B: warm-ups 2(PP - stage - 1) + 1, so that neighbouring stages' pairs do not wait for each
    # other: the last rank pairs all but one, the first all but 2·PP - 1.
    assert paired_share(pp=8, vpp=1, stage=7, num_microbatches=32) == pytest.approx(31 / 32)
    assert paired_share(pp=8, vpp=1, stage=0, num_microbatches=32) == pytest.approx(17 / 32)
    # Interleaved: Megatron-Core's warm-up count + 1 chunk forwards unpaired (pp4 vpp2 last rank: 4 + 1).
    assert paired_share(pp=4, vpp=2, stage=3, num_microbatches=8) == pytest.approx((16 - 5) / 16)
    # The longer warm-up: 2(PP - stage) micro-batches under 1F1B, one more chunk when interleaved,
    # capped by the step's forwards.
    assert in_flight_chunks(pp=8, vpp=1, stage=0, num_microbatches=32, overlap_moe_comm=True) == 16
    assert in_flight_chunks(pp=8, vpp=1, stage=5, num_microbatches=32, overlap_moe_comm=True) == 6
    assert in_flight_chunks(pp=8, vpp=1, stage=0, num_microbatches=8, overlap_moe_comm=True) == 8
    assert in_flight_chunks(pp=4, vpp=2, stage=0, num_microbatches=8, overlap_moe_comm=True) == 6 + 4 + 1 + 1
    assert in_flight_chunks(pp=1, vpp=1, stage=0, num_microbatches=4, overlap_moe_comm=True) == 2


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(vpp=7),
        dict(recompute="moe"),
        dict(recompute="full", vpp=7),
        dict(ep=8, etp=2, edp=1, folded=False),  # unfolded: the TP2·EP8 dispatch group spans two nodes
        dict(tp=4, ep=4, etp=2, dp=4, edp=2),  # ETP all-gather / reduce-scatter too
        dict(pp=1, tp=8, ep=8, etp=1, dp=16, edp=16),  # no pipelining: gradient accumulation only
    ],
)
def test_overlap_never_slower_and_exposes_less(kw):
    off = _plan(**kw)
    t_off = estimate_step_time(MIXTRAL, off, shape=SHAPE, cluster=CLUSTER, compute_efficiency=0.651)
    plain = dataclasses.replace(off, overlap_moe_comm=False)
    default = estimate_step_time(MIXTRAL, plain, shape=SHAPE, cluster=CLUSTER, compute_efficiency=0.651)
    assert default == t_off  # overlap off is the default, numbers unchanged
    for delay in (False, True):
        on = dataclasses.replace(off, overlap_moe_comm=True, delay_wgrad=delay)
        t_on = estimate_step_time(MIXTRAL, on, shape=SHAPE, cluster=CLUSTER, compute_efficiency=0.651)
        assert t_on.step_s < t_off.step_s
        assert 0 < t_on.breakdown["ep"] < t_off.breakdown["ep"]
        # the other terms are those of the slowest stage, which the overlap may change (its paired share
        # differs per stage under 1F1B), so they are not compared here


def test_hidden_exchanges_bounded_by_the_compute_they_hide_behind():
    gpu = get_gpu("h100")
    on = _plan(pp=1, tp=1, ep=8, dp=16, edp=2, overlap_moe_comm=True)
    c = gpu.overlap_contention
    # Mixtral-8x22B's exchanges within the compute of each piece: all hidden, only the contention is paid.
    fast = Cluster(gpu=gpu, num_gpus=16)
    lay = _layer_times(MIXTRAL, on, SHAPE, fast, 0.651, True)
    assert lay["ep_paired"] == pytest.approx(c * lay["ep"])  # unpaired: all 4 exposed (no shared expert)
    # A network 500x slower: every exchange outlasts its compute, the rest is exposed. All four pieces
    # together are the layer's compute (less the host sync of the dispatcher), each hidden at most once.
    slow_gpu = dataclasses.replace(gpu, internode_bandwidth=gpu.internode_bandwidth / 500)
    slow = Cluster(gpu=slow_gpu, num_gpus=16, nvlink_domain=4)  # EP8 over two NVLink domains
    lay = _layer_times(MIXTRAL, on, SHAPE, slow, 0.651, True)
    pieces = lay["compute"] - gpu.host_sync_s
    assert lay["ep"] > 2 * pieces  # the exchanges are far longer than the compute
    assert lay["ep_paired"] == pytest.approx(lay["ep"] - (1 - c) * pieces)
    t_off = estimate_step_time(
        MIXTRAL, dataclasses.replace(on, overlap_moe_comm=False), shape=SHAPE, cluster=slow, compute_efficiency=0.651
    )
    t_on = estimate_step_time(MIXTRAL, on, shape=SHAPE, cluster=slow, compute_efficiency=0.651)
    assert t_off.breakdown["ep"] - t_on.breakdown["ep"] < t_on.breakdown["compute"]


@pytest.mark.parametrize("vpp", [1, 7])
def test_memory_with_overlap_is_the_longer_warmup(vpp):
    kw = dict(distributed=True, recompute="none", seq_length=4096, micro_batch_size=1, num_microbatches=32)
    plan = _plan(vpp=vpp)
    layer = activation_bytes_per_layer(MIXTRAL, plan, seq_length=4096, micro_batch_size=1)
    rope = rope_bytes(MIXTRAL, plan, seq_length=4096)  # every chunk forward's RoPE tables
    for stage in (0, 3):
        off = memory_per_rank(MIXTRAL, plan, stage=stage, **kw)
        on = memory_with_overlap(MIXTRAL, plan, stage=stage, **kw)
        extra = (8 - stage) if vpp == 1 else 1  # micro-batches (1F1B) or one chunk (interleaved)
        assert on.total - off.total == pytest.approx(extra * (layer * 7 / vpp + rope), abs=1)  # 7 layers per rank
    # The last rank's chunk also keeps the fused loss's input and log-sum-exp of that micro-batch.
    tokens = 4096
    last = memory_with_overlap(MIXTRAL, plan, stage=7, **kw).total - memory_per_rank(MIXTRAL, plan, stage=7, **kw).total
    assert last == pytest.approx(layer * 7 / vpp + rope + 2 * tokens * MIXTRAL.hidden_size + 4 * tokens, abs=1)
    # The planner's memory call takes it too.
    r_off, r_on = (
        evaluate(MIXTRAL, dataclasses.replace(plan, overlap_moe_comm=o), cluster=CLUSTER, shape=SHAPE) for o in (0, 1)
    )
    peak = r_on.memory.stage
    extra = (8 - peak) if vpp == 1 else 1
    assert r_on.memory.total - memory_per_rank(MIXTRAL, plan, stage=peak, **kw).total >= extra * layer * 7 / vpp - 1
    assert plan_memory(MIXTRAL, dataclasses.replace(plan, overlap_moe_comm=True), shape=SHAPE) == r_on.memory


def test_no_extra_memory_when_every_forward_is_already_in_flight():
    plan = _plan()  # PP8: 8 in flight on stage 0 already
    assert (
        overlap_activation_bytes(MIXTRAL, plan, stage=0, seq_length=4096, micro_batch_size=1, num_microbatches=8) == 0
    )
    one = _plan(pp=1, tp=8, dp=16, edp=16)
    assert overlap_activation_bytes(MIXTRAL, one, stage=0, seq_length=4096, micro_batch_size=1, num_microbatches=1) == 0
    assert overlap_activation_bytes(MIXTRAL, one, stage=0, seq_length=4096, micro_batch_size=1, num_microbatches=2) > 0


def _tool(*extra):
    args = ["--model", "mixtral_tiny", "--world", "4", "--seq-length", "16", "--global-batch-size", "8", "--json"]
    return subprocess.run([sys.executable, "-m", "tools.plan", *args, *extra], capture_output=True, text=True, cwd=ROOT)


def test_tool_overlap_flags():
    import json

    off, on = _tool(), _tool("--overlap-moe-comm", "--delay-wgrad")
    assert off.returncode == 0 and on.returncode == 0, on.stderr
    best_off, best_on = json.loads(off.stdout)[0], json.loads(on.stdout)[0]
    assert best_on["overlap_moe_comm"] and best_on["delay_wgrad"] and not best_off["overlap_moe_comm"]
    assert best_on["step_s"] <= best_off["step_s"]
    bad = _tool("--delay-wgrad")
    assert bad.returncode == 2 and "--overlap-moe-comm" in bad.stderr and not bad.stdout


def test_dry_run_memory_with_the_option():
    register_schema()
    with initialize_config_dir(config_dir=os.path.abspath(os.path.join(ROOT, "configs")), version_base="1.3"):
        trees = [
            OmegaConf.to_container(compose("config", overrides=["recipes=mixtral_8x22b", *o]), resolve=True)
            for o in ([], ["parallel.overlap_moe_comm=true", "parallel.delay_wgrad=true"])
        ]
    off, on = (job_config_from_dict(t) for t in trees)
    assert not off.parallel.overlap_moe_comm and on.parallel.overlap_moe_comm and on.parallel.delay_wgrad
    layout = off.parallel.layout(128, off.model.moe.num_experts)
    m_off, m_on = memory_estimate(off, layout), memory_estimate(on, layout)
    extra = overlap_activation_bytes(
        off.model, layout, stage=m_on.stage, seq_length=4096, micro_batch_size=1, num_microbatches=32
    )
    assert extra > 0 and m_on.total == m_off.total + extra
