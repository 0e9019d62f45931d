"""The training loss is the token-weighted loss of the global batch, through the real training path.

Hand-made global batch with uneven loss masks (every sequence keeps a different number of tokens,
so micro-batches and DP ranks hold different counts) fed to ``trainer.train`` on several layouts
and micro-batch sizes. Independent reference: one rank, plain autograd on the whole global batch,
``loss_BS.sum() / loss_mask.sum()`` -- no schedule, no loss scaling by the engine. A per-micro-batch
(or per-rank) mean would differ here, since the counts differ.
"""

import dataclasses
import math

import torch
import torch.distributed as dist

from folding.model.transformer import MoETransformer
from folding.moe.settings import LayerSettings
from folding.parallel import ParallelLayout, build_parallel_state
from folding.training import trainer
from tests.distributed.test_train_e2e import tiny_job

GB, S = 8, 16


def _global_batch(vocab):
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(0, vocab, (GB, S), generator=g)
    labels = torch.randint(0, vocab, (GB, S), generator=g)
    keep = [16, 3, 11, 7, 1, 16, 5, 9]  # unmasked tokens per sequence: all different
    mask = torch.zeros(GB, S)
    for i, k in enumerate(keep):
        mask[i, S - k :] = 1.0  # e.g. left padding
    return ids, labels, mask


def _job(parallel, mbs, run_dir):
    job = tiny_job(parallel, f"{run_dir}/m.jsonl", steps=1, micro_batch_size=mbs, eval_interval=0)
    return dataclasses.replace(job, model=job.model.replace(moe={"aux_loss_coeff": 0.0, "z_loss_coeff": 0.0}))


def _train(cases, run_dir):
    """Step-1 ``(lm_loss, grad_norm)`` of ``trainer.train`` per ``(parallel, micro_batch_size)``."""
    out = []
    for parallel, mbs in cases:
        job = _job(parallel, mbs, run_dir)
        prep = trainer.prepare(job, world_size=dist.get_world_size(), rank=dist.get_rank())
        ids, labels, mask = _global_batch(job.model.vocab_size)
        per = GB // prep.layout.dp  # this DP rank's contiguous samples
        lo = prep.dp_rank * per
        prep.data.train = iter(
            [
                {"tokens": ids[i : i + mbs], "labels": labels[i : i + mbs], "loss_mask": mask[i : i + mbs]}
                for i in range(lo, lo + per, mbs)
            ]
        )
        h = trainer.train(job, run_dir=run_dir, prepared=prep)["history"][0]
        out.append((h["lm_loss"], h["grad_norm"]))
    return out


def _reference(run_dir):
    """One rank, plain autograd: masked loss sum over the whole global batch / its token count."""
    job = _job({}, GB, run_dir)
    with build_parallel_state(ParallelLayout(world_size=1)) as ps:
        model = MoETransformer(job.model, parallel_state=ps, settings=LayerSettings(init_seed=job.train.seed))
        ids, labels, mask = _global_batch(job.model.vocab_size)
        loss = (model(ids, labels=labels) * mask).sum() / mask.sum()
        loss.backward()
        norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters() if p.grad is not None))
    return float(loss), norm


def test_loss_is_token_weighted_over_the_global_batch(ranks, tmp_path):
    ref_loss, ref_norm = ranks(1).run(_reference, str(tmp_path))[0]
    one = ranks(1).run(_train, [({}, 1), ({}, 4)], str(tmp_path / "one"))[0]
    four = ranks(4).run(_train, [(dict(ep=2, etp=1), 1), (dict(tp=2, ep=4, etp=1), 2)], str(tmp_path / "four"))
    results = one + four[0]
    # fp32: the engine sums the same terms in another order (micro-batches, DP all-reduce, TP shards);
    # round-off is ~1e-7 relative, far below what a per-micro-batch mean moves here (>1e-2)
    for lm, norm in results:
        assert abs(lm - ref_loss) <= 2e-6 * ref_loss, (lm, ref_loss)
        assert abs(norm - ref_norm) <= 2e-5 * ref_norm, (norm, ref_norm)
    for rank_out in four:
        assert rank_out == four[0]  # every rank reports the same step
