"""Aux-loss-free expert bias through ``trainer.train`` on layouts with DP > 1 equals one rank.

The bias moves by ``rate * sign(mean - count)`` with the token counts of the *global* batch (summed
over TP x DP x CP): a reduction over a smaller group gives each DP rank its own counts, hence other
signs, other biases on different ranks and other routing. Compared: every step's loss and the final
bias buffers of every MoE layer, on every rank.
"""

import dataclasses

import torch

from folding.training import trainer
from tests.distributed.test_train_e2e import tiny_job

STEPS = 4


def _train(layouts, run_dir):
    out = []
    for i, parallel in enumerate(layouts):
        job = tiny_job(parallel, f"{run_dir}/m{i}.jsonl", steps=STEPS, eval_interval=0)
        moe = {"expert_bias": True, "expert_bias_update_rate": 0.05}
        job = dataclasses.replace(job, model=job.model.replace(moe=moe))
        res = trainer.train(job, run_dir=run_dir)
        biases = [
            m.expert_bias.clone()
            for c in res["chunks"]
            for m in c.modules()
            if getattr(m, "expert_bias", None) is not None
        ]
        out.append(([h["loss"] for h in res["history"]], biases))
    return out


def test_expert_bias_through_training_matches_one_rank(ranks, tmp_path):
    ((ref_losses, ref_bias),) = ranks(1).run(_train, [{}], str(tmp_path / "one"))[0]
    assert len(ref_bias) == 2 and any(b.abs().sum() > 0 for b in ref_bias)  # the bias really moved
    four = ranks(4).run(_train, [dict(ep=2, etp=1), dict(tp=2, ep=4, etp=1)], str(tmp_path / "four"))
    for rank_out in four:
        for losses, biases in rank_out:
            # fp32 loss round-off across layouts is ~1e-7 relative; the bias moves in steps of 0.05
            for a, b in zip(losses, ref_losses):
                assert abs(a - b) <= 1e-5 * abs(b), (losses, ref_losses)
            for b, r in zip(biases, ref_bias):
                assert torch.equal(b, r), (b, r)
