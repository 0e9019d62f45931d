"""Reduced gradients of the real training path, tensor by tensor, against plain autograd on 1 rank.

``trainer.train`` runs one step on hand-made micro-batches with uneven loss masks and the router's
aux loss on; just before the update, every parameter's reduced gradient (``main_grad``, the whole
of it: non-distributed optimizer) is compared with the matching slice of the 1-rank gradient of
``Σ_mb [masked loss sum_mb / N + aux_mb / (micro-batches of the global batch)]``. Layouts: TP2 with
sequence parallelism (norm and router gradients summed over TP), EP4 with EDP 1 != DP 2 and EP2 x
ETP2 with EDP 1 != DP 4 (expert gradients over EDP, dense over DP x CP).
"""

import dataclasses

import torch.distributed as dist

from folding.model.transformer import MoETransformer
from folding.moe.settings import LayerSettings
from folding.optim.optimizer import FoldedOptimizer
from folding.parallel import ParallelLayout, build_parallel_state
from folding.parallel.params import require_spec, take_slice
from folding.training import trainer
from tests.distributed.test_loss_weighting import GB, _global_batch
from tests.distributed.test_train_e2e import tiny_job

MBS = 1


def _job(parallel, run_dir):
    job = tiny_job(parallel, f"{run_dir}/m.jsonl", steps=1, micro_batch_size=MBS, global_batch_size=GB, eval_interval=0)
    assert job.moe.aux_loss_coeff > 0  # the preset's aux loss is on: its weight is checked too
    # clipping off: main_grad is compared after clip_and_step, which scales it in place when clipping
    return dataclasses.replace(job, optim=dataclasses.replace(job.optim, distributed=False, clip_grad=0.0))


def _reduced(cases, run_dir):
    out = []
    real = FoldedOptimizer.clip_and_step
    for parallel in cases:
        job = _job(parallel, run_dir)
        prep = trainer.prepare(job, world_size=dist.get_world_size(), rank=dist.get_rank())
        ids, labels, mask = _global_batch(job.model.vocab_size)
        per = GB // prep.layout.dp
        lo = prep.dp_rank * per
        prep.data.train = iter(
            [
                {"tokens": ids[i : i + MBS], "labels": labels[i : i + MBS], "loss_mask": mask[i : i + MBS]}
                for i in range(lo, lo + per, MBS)
            ]
        )
        seen, built = {}, []
        real_build = trainer.build_stage_chunks

        def build(**kw):
            built.extend(real_build(**kw))
            return built

        def snapshot(self):
            res = real(self)  # reduces, clips (the norm is returned), steps; main_grad stays reduced
            chunk = built[0]  # pp = 1: one chunk; its groups are alive until train() returns
            for name, p in chunk.named_parameters():
                seen[name] = (p.main_grad.detach().clone().view(p.shape), require_spec(p, name).shards)
            return res

        FoldedOptimizer.clip_and_step, trainer.build_stage_chunks = snapshot, build
        try:
            trainer.train(job, run_dir=run_dir, prepared=prep)
        finally:
            FoldedOptimizer.clip_and_step, trainer.build_stage_chunks = real, real_build
        out.append((parallel, seen))
    return out


def _reference(run_dir):
    job = _job({}, run_dir)
    with build_parallel_state(ParallelLayout(world_size=1)) as ps:
        # each micro-batch's aux loss, averaged
        settings = LayerSettings(init_seed=job.train.seed, aux_loss_scale=1.0 / (GB // MBS))
        model = MoETransformer(job.model, parallel_state=ps, settings=settings)
        ids, labels, mask = _global_batch(job.model.vocab_size)
        n = mask.sum()
        for i in range(0, GB, MBS):
            loss = (model(ids[i : i + MBS], labels=labels[i : i + MBS]) * mask[i : i + MBS]).sum() / n
            loss.backward()
        return {name: (p.grad.clone(), require_spec(p, name).full_shape) for name, p in model.named_parameters()}


def test_reduced_gradients_match_one_rank_tensor_by_tensor(ranks, tmp_path):
    ref = ranks(1).run(_reference, str(tmp_path / "ref"))[0]
    results = ranks(4).run(
        _reduced, [dict(tp=2, ep=2, etp=1), dict(tp=2, ep=4, etp=1), dict(ep=2, etp=2)], str(tmp_path / "four")
    )
    checked = 0
    for rank_out in results:
        for parallel, grads in rank_out:
            assert set(grads) == set(ref)
            for name, (g, shards) in grads.items():
                full, shape = ref[name]
                want = take_slice(full.reshape(shape), shards).reshape(g.shape)
                # fp32: the same products summed in another order (micro-batches, DP/EDP/TP
                # all-reduces); round-off ~1e-7 of the largest entry. A missing TP sum halves a
                # sequence-parallel gradient, a wrong group or aux weight moves it by >1e-2.
                err = (g - want).abs().max().item()
                assert err <= 1e-5 * want.abs().max().item() + 1e-8, (parallel, name, err)
                checked += 1
    assert checked == 4 * 3 * len(ref)
