"""Gradient reduction starts inside the pipeline schedule, during each chunk's last backward.

On 4 gloo ranks (PP2 VPP2 with DP2, and PP1 with TP2 DP2), tiny Mixtral with small buckets runs one
step of 4 micro-batches through ``run_microbatches``. With the optimizer's ``no_sync`` passed (the
trainer's path), buckets must already be launched when the schedule returns; reducing them all
afterwards (the whole schedule inside ``no_sync``) must give the same reduced gradients, bit for bit.
"""

import torch
import torch.distributed as dist

from folding.model.chunks import build_stage_chunks
from folding.model.presets import get_preset
from folding.moe.settings import LayerSettings
from folding.optim.config import OptimConfig
from folding.optim.optimizer import FoldedOptimizer
from folding.parallel import ParallelLayout, build_parallel_state
from folding.pipeline.stage import run_microbatches

M, S = 4, 16


def _reduced_grads(layout_kw, overlap_in_schedule: bool):
    torch.set_num_threads(1)
    cfg = get_preset("mixtral_tiny", hidden_size=32, moe=dict(ffn_hidden_size=16))
    with build_parallel_state(
        ParallelLayout(world_size=dist.get_world_size(), num_experts=cfg.moe.num_experts, **layout_kw)
    ) as ps:
        chunks = build_stage_chunks(model_config=cfg, parallel_state=ps, settings=LayerSettings(init_seed=3))
        opt = FoldedOptimizer(
            torch.nn.ModuleList(chunks),
            OptimConfig(lr=1e-3, bucket_size=2000, distributed=True),
            parallel_state=ps,
            train_steps=1,
        )
        g = torch.Generator().manual_seed(11 + ps.coords.dp.rank)  # one batch per data-parallel replica
        mbs = [
            dict(tokens=t, labels=torch.roll(t, -1, 1), loss_mask=torch.ones(1, S))
            for t in (torch.randint(0, cfg.vocab_size, (1, S), generator=g) for _ in range(M))
        ]
        opt.zero_grad()
        if overlap_in_schedule:
            run_microbatches(chunks, mbs, parallel_state=ps, loss_scale=1.0 / (M * S), no_sync=opt.no_sync)
        else:
            with opt.no_sync():
                run_microbatches(chunks, mbs, parallel_state=ps, loss_scale=1.0 / (M * S))
        launched = sum(b.launched for _, b in opt.reducer.order)
        buckets = len(opt.reducer.order)
        opt.reduce_gradients()
        grads = [buf.main_grad.clone() for buf in opt.buffers]
    return launched, buckets, grads


def _both(layout_kw):
    return _reduced_grads(layout_kw, True), _reduced_grads(layout_kw, False)


def test_reduction_starts_in_the_schedule_and_matches_reducing_after(ranks):
    for layout_kw in (dict(pp=2, vpp=2, ep=2, etp=1), dict(tp=2, ep=2, etp=1)):
        for (launched, buckets, grads), (launched_after, _, grads_after) in ranks(4).run(_both, layout_kw):
            assert buckets > 2, (layout_kw, buckets)
            assert launched > 0, f"{layout_kw}: no bucket launched during the schedule ({buckets} buckets)"
            assert launched_after == 0, (layout_kw, launched_after)
            for a, b in zip(grads, grads_after):
                assert torch.equal(a, b), layout_kw
            assert max(g.abs().max().item() for g in grads) > 0
