"""A checkpoint saved in one layout resumes in another and trains exactly like an uninterrupted run.

Run A trains 3 steps (``train.steps=3``, ``optim.decay_steps=6``) and saves at step 3; run B
(``train.steps=6``) loads it in a layout with different TP, PP and EP (and ``optim.distributed``
flipped) and trains steps 4-6. Its losses and grad norms must equal those of an uninterrupted
6-step run (fp32: relative 1e-5 on losses, 1e-4 on grad norms), and its final parameters too.
Everything runs through the real trainer on 4 gloo ranks.
"""

import math
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from folding.data.config import DataConfig
from folding.model.presets import get_preset
from folding.optim.config import OptimConfig
from folding.parallel import build_parallel_state
from folding.parallel.params import require_spec
from folding.training.config import (
    CheckpointConfig,
    JobConfig,
    LoggingConfig,
    ParallelConfig,
    TrainConfig,
    WandbConfig,
)

WORLD = 4
# (layout of run A, optim.distributed of A) -> (layout of run B, optim.distributed of B)
PAIRS = [
    ((dict(tp=2, pp=2, ep=2, etp=1), True), (dict(tp=1, pp=1, ep=4, etp=1), False)),
    ((dict(tp=1, pp=1, ep=4, etp=1), False), (dict(tp=2, pp=2, ep=1, etp=2), True)),
    ((dict(pp=2, vpp=2, ep=2, etp=1), True), (dict(tp=2, ep=4, etp=1), True)),
]
REFERENCE = (dict(tp=2, ep=2, etp=1), False)


def _job(parallel, distributed, steps, ckpt_dir=None, load=None):
    model = get_preset("mixtral_tiny", hidden_size=32, moe={"ffn_hidden_size": 16})
    return JobConfig(
        model=model,
        parallel=ParallelConfig(**parallel),
        train=TrainConfig(
            steps=steps, global_batch_size=8, micro_batch_size=1, seq_length=16, eval_interval=0, seed=11
        ),
        optim=OptimConfig(
            lr=3e-3,
            min_lr=3e-4,
            warmup_steps=2,
            decay_steps=6,
            decay_style="cosine",
            clip_grad=1.0,
            weight_decay=0.01,
            eps=1e-6,
            distributed=distributed,
        ),
        data=DataConfig(),
        checkpoint=CheckpointConfig(dir=ckpt_dir, load=load),
        logging=LoggingConfig(metrics_file="metrics.jsonl", console=False, wandb=WandbConfig(mode="disabled")),
    )


def _run(job, run_dir):
    from folding.training import trainer

    ps = build_parallel_state(job.layout(dist.get_world_size()))
    try:
        res = trainer.train(job, run_dir=run_dir, parallel_state=ps)
        params = {
            n: (require_spec(p, n).full_shape, require_spec(p, n).shards, p.detach().clone())
            for c in res["chunks"]
            for n, p in c.named_parameters()
        }
    finally:
        ps.destroy()
    hist = [(h["step"], h["lm_loss"], h["grad_norm"], h["lr"]) for h in res["history"]]
    return hist, res["resumed_from"], params


def _resume_cases(root):
    out = {"reference": _run(_job(*REFERENCE, steps=6), root)[:2]}
    for i, ((la, da), (lb, db)) in enumerate(PAIRS):
        d = os.path.join(root, f"pair{i}")
        a = _run(_job(la, da, steps=3, ckpt_dir=d), root)
        b = _run(_job(lb, db, steps=6, load=d), root)
        out[i] = (a[0], b[0], b[1], b[2])
    return out


def _assemble(per_rank_params):
    from folding.parallel.params import take_slice

    full = {}
    for params in per_rank_params:
        for name, (shape, shards, local) in params.items():
            t = full.setdefault(name, torch.full(shape, float("nan")))
            take_slice(t, shards).copy_(local.reshape(take_slice(t, shards).shape))
    return full


def test_resume_in_another_layout_matches_uninterrupted(ranks, tmp_path):
    results = ranks(WORLD).run(_resume_cases, str(tmp_path))
    ref, _ = results[0]["reference"]
    assert [s for s, *_ in ref] == [1, 2, 3, 4, 5, 6]
    for i, pair in enumerate(PAIRS):
        hist_a, hist_b, resumed, _ = results[0][i]
        assert [s for s, *_ in hist_a] == [1, 2, 3], pair
        assert [s for s, *_ in hist_b] == [4, 5, 6], pair  # B continued, did not restart
        assert resumed and resumed.endswith("step_00000003"), resumed
        for (step, loss, norm, lr), (rs, rloss, rnorm, rlr) in zip(hist_a + hist_b, ref):
            assert step == rs
            assert abs(loss - rloss) <= 1e-5 * abs(rloss), (pair, step, loss, rloss)
            assert abs(norm - rnorm) <= 1e-4 * abs(rnorm), (pair, step, norm, rnorm)
            assert abs(lr - rlr) <= 1e-12, (pair, step, lr, rlr)  # LR schedule position restored
    # every tensor is stored once: its saved chunks tile the full tensor without overlap (replicas deduplicated)
    md = dcp.FileSystemReader(str(tmp_path / "pair0" / "step_00000003")).read_metadata().state_dict_metadata
    assert any(k.startswith("optim/") for k in md) and any(k.startswith("model/layers.") for k in md)
    for key, m in md.items():
        if hasattr(m, "chunks"):
            assert sum(math.prod(c.sizes) for c in m.chunks) == math.prod(m.size), key
    # the final parameters of two different resumed layouts agree with each other
    f0 = _assemble([results[r][0][3] for r in range(WORLD)])
    f1 = _assemble([results[r][1][3] for r in range(WORLD)])
    assert sorted(f0) == sorted(f1)
    for name in f0:
        assert not torch.isnan(f0[name]).any() and not torch.isnan(f1[name]).any(), name
        torch.testing.assert_close(f0[name], f1[name], rtol=1e-4, atol=1e-5, msg=name)
