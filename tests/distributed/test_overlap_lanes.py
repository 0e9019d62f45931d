"""The lanes of ``parallel.overlap_moe_comm`` in a real training step (2 gloo ranks, EP2).

Tiny Mixtral (2 layers) with router input jitter (``moe.input_jitter_eps``) and the MoE layers
recomputed in backward (``train.recompute=moe``, non-reentrant: the recompute re-runs the dispatch,
so it hands over while it holds the forward's generator state) trains two steps of 4 micro-batches
with overlap on and off. Checked on every rank:

- the losses and gradients with overlap on are bitwise those without (each lane draws from its own
  copy of the generators across a hand-over: :mod:`folding.overlap.exchange`);
- the second lane of every pair ran on one thread, the same in both steps;
- the grouped-GEMM backend probe ran once, before any pair, although the model was built on ``meta``
  and materialized (the trainer's path when it starts from Hugging Face weights).
"""

import dataclasses
import threading

import torch
import torch.distributed as dist

from folding.model.chunks import build_stage_chunks
from folding.model.presets import get_preset
from folding.moe.experts import backends as expert_backends
from folding.moe.layer import MoELayer
from folding.moe.settings import LayerSettings
from folding.overlap.runtime import OverlapRuntime
from folding.parallel import ParallelLayout, build_parallel_state
from folding.parallel.params import materialize
from folding.pipeline.stage import run_microbatches

M, S, STEPS = 4, 16, 2


def _train(overlap_on: bool):
    cfg = get_preset("mixtral_tiny", num_layers=2)
    cfg = dataclasses.replace(cfg, moe=cfg.moe.replace(input_jitter_eps=0.2))
    probes, lanes = [], []
    runtime = OverlapRuntime()  # both steps': one helper thread, one set of counters
    probe = expert_backends._probe_grouped_mm

    def counting(*args):
        probes.append(runtime.running_lane())
        return probe(*args)

    expert_backends.torch_grouped_mm_supported.cache_clear()
    expert_backends._probe_grouped_mm = counting
    try:
        with build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), ep=2, etp=1)) as ps:
            settings = LayerSettings(recompute="moe", overlap_comm=overlap_on, device="meta")
            chunks = build_stage_chunks(model_config=cfg, parallel_state=ps, settings=settings)
            for c in chunks:
                materialize(c, device="cpu", init_seed=3)
                c.train()
                for m in c.modules():
                    if isinstance(m, MoELayer):
                        m.register_forward_pre_hook(
                            lambda *_: lanes.append((runtime.running_lane(), threading.get_ident()))
                        )
            built = list(probes)
            torch.manual_seed(7)  # the jitter's draws
            g = torch.Generator().manual_seed(11 + ps.rank)
            losses = []
            for _ in range(STEPS):
                mbs = [
                    dict(tokens=t, labels=torch.roll(t, -1, 1), loss_mask=torch.ones(1, S))
                    for t in (torch.randint(0, cfg.vocab_size, (1, S), generator=g) for _ in range(M))
                ]
                out = run_microbatches(
                    chunks, mbs, parallel_state=ps, loss_scale=1.0 / (M * S), overlap=overlap_on, runtime=runtime
                )
                losses.append(out["lm_loss_sum"])
            grads = [p.grad.clone() for c in chunks for p in c.parameters() if p.grad is not None]
    finally:
        runtime.close()
        expert_backends._probe_grouped_mm = probe
        expert_backends.torch_grouped_mm_supported.cache_clear()
    return dict(
        losses=losses,
        grads=grads,
        rng=torch.get_rng_state(),
        hand_overs=runtime.stats.hand_overs,
        built=built,
        probes=probes,
        lanes=lanes,
    )


def _on_and_off():
    torch.set_num_threads(1)
    return _train(True), _train(False)


def test_jitter_with_recompute_trains_bitwise_as_without_overlap_on_one_lane_thread(ranks):
    for r, (on, off) in enumerate(ranks(2).run(_on_and_off)):
        assert on["hand_overs"] > 0 and off["hand_overs"] == 0, r  # the pairs ran and switched lanes
        for a, b in zip(on["losses"], off["losses"]):
            assert torch.equal(a, b), (r, on["losses"], off["losses"])
        assert len(on["grads"]) == len(off["grads"]) > 0
        for a, b in zip(on["grads"], off["grads"]):
            assert torch.equal(a, b), r
        assert torch.equal(on["rng"], off["rng"]), r  # the same draws were left for what follows
        # the probe: once, where the backend is decided (the build, although on meta), never in a pair
        assert on["built"] == [None] and on["probes"] == [None], (r, on["probes"])
        helper = {ident for lane, ident in on["lanes"] if lane == 1}
        assert len(helper) == 1, (r, helper)  # one persistent thread for every pair of both steps
        assert sum(lane == 1 for lane, _ in on["lanes"]) >= STEPS * 2, (r, on["lanes"])
