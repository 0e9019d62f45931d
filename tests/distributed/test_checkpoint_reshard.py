"""A checkpoint saved in one layout resumes in another and trains exactly like an uninterrupted run.

Run A trains 3 steps (``train.steps=3``, ``optim.decay_steps=6``) and saves at step 3; run B
(``train.steps=6``) loads it in a layout with different TP, PP and EP, or another cut of the same pipeline
(``parallel.pipeline_layout`` against the even split), and ``optim.distributed`` flipped, and trains steps
4-6. Its losses and grad norms must equal those of an uninterrupted 6-step run (fp32: relative 1e-5 on
losses, 1e-4 on grad norms), and its final parameters too.
Everything runs through the real trainer on 4 gloo ranks.

With bf16 moments (``optim.exp_avg_dtype=exp_avg_sq_dtype=bf16``, the ``moments`` parameter; two of
the pairs) the checkpoint stores the moments in bf16 and the resumed runs meet the same tolerances
against an uninterrupted bf16-moment run. A resume into other state dtypes converts, with a warning.

Hot-expert replicas (``moe.expert_replicas``) are not parameters: a run saved with replicas in use
(EP4, re-planned every step) holds the logical experts only, and resumes without replicas in another
layout, or with replicas in another one, like an uninterrupted run without replicas.

With Muon (``optim.name=muon``, ``moments="muon"``; two of the pairs, ZeRO-1 on either side) the
checkpoint stores Muon's fp32 momentum (assembled from its owners under ZeRO-1) beside the AdamW
moments of the other parameters; the resumed runs meet the fp32 tolerances, the resharded load is bit
for bit what was saved, and resuming the Muon checkpoint with AdamW fails naming ``optim.name``.
"""

import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from folding.data.config import DataConfig
from folding.job.config import (
    CheckpointConfig,
    JobConfig,
    LoggingConfig,
    ParallelConfig,
    TrainConfig,
    WandbConfig,
)
from folding.model.presets import get_preset
from folding.optim.config import OptimConfig
from folding.parallel import build_parallel_state
from folding.parallel.params import require_spec

WORLD = 4
# (layout of run A, optim.distributed of A) -> (layout of run B, optim.distributed of B)
PAIRS = [
    ((dict(tp=2, pp=2, ep=2, etp=1), True), (dict(tp=1, pp=1, ep=4, etp=1), False)),
    ((dict(tp=1, pp=1, ep=4, etp=1), False), (dict(tp=2, pp=2, ep=1, etp=2), True)),
    ((dict(pp=2, vpp=2, ep=2, etp=1), True), (dict(tp=2, ep=4, etp=1), True)),
    # another cut of the same pipeline: a layout with an empty stage (rank 1: nothing, then the loss) saved,
    # the even VPP2 split loaded
    ((dict(pp=2, ep=2, etp=1, pipeline_layout="Et||ttt|L"), False), (dict(pp=2, vpp=2, ep=2, etp=1), True)),
]
REFERENCE = (dict(tp=2, ep=2, etp=1), False)


def _job(parallel, distributed, steps, ckpt_dir=None, load=None, moments="fp32", moe=None):
    model = get_preset("mixtral_tiny", hidden_size=32, moe={"ffn_hidden_size": 16, **(moe or {})})
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
            exp_avg_dtype="fp32" if moments == "muon" else moments,
            exp_avg_sq_dtype="fp32" if moments == "muon" else moments,
            name="muon" if moments == "muon" else "adamw",
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
        # the AdamW state by parameter (collective under ZeRO-1), as the checkpoint stores it
        canon = {id(p): n for c in res["chunks"] for n, p in c.named_parameters()}
        opt = res["optimizer"]
        st = opt.param_state()
        state = {
            canon[id(p)]: (require_spec(p, o).full_shape, require_spec(p, o).shards, st[o])
            for buf in opt.buffers
            for o, p in zip(buf.names, buf.params)
        }
    finally:
        ps.destroy()
    hist = [(h["step"], h["lm_loss"], h["grad_norm"], h["lr"]) for h in res["history"]]
    return hist, res["resumed_from"], params, state


def _resume_cases(root, moments="fp32", pairs=PAIRS):
    out = {"reference": _run(_job(*REFERENCE, steps=6, moments=moments), root)[:2]}
    for i, ((la, da), (lb, db)) in enumerate(pairs):
        d = os.path.join(root, f"pair{i}")
        a = _run(_job(la, da, steps=3, ckpt_dir=d, moments=moments), root)
        b = _run(_job(lb, db, steps=6, load=d, moments=moments), root)
        out[i] = (a[0], b[0], b[1], b[2])
        if moments != "fp32":  # B's state right after the load (no step run) against A's at the save
            loaded = _run(_job(lb, db, steps=3, load=d, moments=moments), root)
            out[f"state{i}"] = (a[3], loaded[3])
    if moments == "muon":  # the first pair's Muon checkpoint resumed with AdamW: refused
        try:
            _run(_job(*pairs[0][1], steps=4, load=os.path.join(root, "pair0")), root)
            out["other_optimizer"] = None
        except Exception as e:  # noqa: BLE001 - the message is the point
            out["other_optimizer"] = f"{type(e).__name__}: {e}"
    elif moments != "fp32":  # the first pair's checkpoint resumed with fp32 moments: converted, warned
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c = _run(_job(*pairs[0][1], steps=4, load=os.path.join(root, "pair0")), root)
        out["converted"] = (c[0], [str(w.message) for w in caught])
    return out


def _assemble(per_rank_params, dtype=torch.float32):
    from folding.parallel.params import take_slice

    full = {}
    for params in per_rank_params:
        for name, (shape, shards, local) in params.items():
            t = full.setdefault(name, torch.full(shape, float("nan"), dtype=dtype))
            take_slice(t, shards).copy_(local.reshape(take_slice(t, shards).shape))
    return full


def _assemble_state(per_rank_states, key):
    """Full tensors of one state ``key`` in its stored dtype (bf16 moments stay bf16)."""
    dtype = next(st[key] for _, _, st in per_rank_states[0].values() if key in st).dtype
    return _assemble([{n: (f, s, st[key]) for n, (f, s, st) in r.items() if key in st} for r in per_rank_states], dtype)


@pytest.mark.parametrize("moments", ["fp32", "bf16", "muon"])
def test_resume_in_another_layout_matches_uninterrupted(ranks, tmp_path, moments):
    pairs = PAIRS if moments == "fp32" else PAIRS[:2]  # bf16 / muon: ZeRO-1 saved, ZeRO-1 loaded
    results = ranks(WORLD).run(_resume_cases, str(tmp_path), moments, pairs)
    ref, _ = results[0]["reference"]
    assert [s for s, *_ in ref] == [1, 2, 3, 4, 5, 6]
    for i, pair in enumerate(pairs):
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
        if key.endswith(("/exp_avg", "/exp_avg_sq", "/momentum")):  # stored in the moments' own dtype
            assert m.properties.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}.get(moments, torch.float32)
    if moments == "muon":
        assert any(k.endswith("/momentum") for k in md) and any(k.endswith("/exp_avg") for k in md)
        assert not any(k.startswith("optim/layers.") and k.endswith("experts.fc1_weight/exp_avg") for k in md)
        message = results[0]["other_optimizer"]
        assert message and "optim.name" in message and "muon" in message, message
    elif moments != "fp32":
        hist_c, messages = results[0]["converted"]
        assert [s for s, *_ in hist_c] == [4]
        assert any("optim.exp_avg_dtype: bf16 -> fp32" in m for m in messages), messages
        # bf16 -> fp32 widening is exact, so step 4 is the bf16 run's step 4 up to that step's own
        # rounding of the moments (fp32 from here on)
        assert abs(hist_c[0][1] - ref[3][1]) <= 1e-4 * abs(ref[3][1])
    # the final parameters of two different resumed layouts agree with each other
    f0 = _assemble([results[r][0][3] for r in range(WORLD)])
    f1 = _assemble([results[r][1][3] for r in range(WORLD)])
    assert sorted(f0) == sorted(f1)
    # bf16 moments: where the two layouts' fp32 moments (equal to reduction-order noise) straddle a
    # bf16 rounding boundary they round one bf16 gap (2^-7 relative) apart, which moves that element's
    # update by up to lr * 2^-7 (2.3e-5 at lr 3e-3) per step; three steps after the resume
    atol = 1e-5 if moments in ("fp32", "muon") else 3 * 3e-3 * 2**-7
    for name in f0:
        assert not torch.isnan(f0[name]).any() and not torch.isnan(f1[name]).any(), name
        torch.testing.assert_close(f0[name], f1[name], rtol=1e-4, atol=atol, msg=name)
    if moments != "fp32":  # the resharded load itself is exact: bit for bit what the other layout saved
        for i in range(len(pairs)):
            saved = [results[r][f"state{i}"][0] for r in range(WORLD)]
            loaded = [results[r][f"state{i}"][1] for r in range(WORLD)]
            for key in ("exp_avg", "exp_avg_sq") + (("momentum",) if moments == "muon" else ()):
                a, b = _assemble_state(saved, key), _assemble_state(loaded, key)
                assert sorted(a) == sorted(b)
                dtype = torch.bfloat16 if moments == "bf16" else torch.float32
                for name in a:
                    assert a[name].dtype == dtype and torch.equal(a[name], b[name]), (i, key, name)


REPLICAS = dict(expert_replicas=1, replica_interval=1)


def _replica_resume_cases(root):
    ref = _run(_job(*REFERENCE, steps=6), root)
    d = os.path.join(root, "replicas")
    a = _run(_job(dict(ep=4, etp=1), False, steps=3, ckpt_dir=d, moe=REPLICAS), root)
    b = _run(_job(dict(tp=2, ep=2, etp=1), True, steps=6, load=d), root)  # without replicas
    c = _run(_job(dict(pp=2, ep=2, etp=1), False, steps=6, load=d, moe=REPLICAS), root)  # other layout, with
    return ref[0], ref[2], a[0], b[0], b[1], b[2], c[0], c[2]


def test_resume_with_replicas_in_another_layout_matches_uninterrupted(ranks, tmp_path):
    results = ranks(WORLD).run(_replica_resume_cases, str(tmp_path))
    ref, _, hist_a, hist_b, resumed, _, hist_c, _ = results[0]
    assert resumed and resumed.endswith("step_00000003"), resumed
    for hist in (hist_b, hist_c):
        assert [s for s, *_ in hist] == [4, 5, 6]
        for (step, loss, norm, lr), (rs, rloss, rnorm, rlr) in zip(hist_a + hist, ref):
            assert step == rs
            assert abs(loss - rloss) <= 1e-5 * abs(rloss), (step, loss, rloss)
            assert abs(norm - rnorm) <= 1e-4 * abs(rnorm), (step, norm, rnorm)
            assert abs(lr - rlr) <= 1e-12
    # the checkpoint holds the logical experts only: every tensor's chunks tile its full shape once,
    # the expert weights are [E, ...], and nothing names a replica
    md = dcp.FileSystemReader(str(tmp_path / "replicas" / "step_00000003")).read_metadata().state_dict_metadata
    experts = [k for k in md if k.startswith("model/") and k.endswith(("fc1_weight", "fc2_weight")) and "experts" in k]
    assert experts and all(md[k].size[0] == 8 for k in experts), experts
    assert not any("replica" in k for k in md), sorted(md)
    for key, m in md.items():
        if hasattr(m, "chunks"):
            assert sum(math.prod(c.sizes) for c in m.chunks) == math.prod(m.size), key
    f_ref = _assemble([results[r][1] for r in range(WORLD)])
    for idx in (5, 7):  # resumed without replicas (TP2 EP2), with replicas (PP2 EP2)
        f = _assemble([results[r][idx] for r in range(WORLD)])
        assert sorted(f) == sorted(f_ref)
        for name in f:
            torch.testing.assert_close(f[name], f_ref[name], rtol=1e-4, atol=1e-5, msg=name)
