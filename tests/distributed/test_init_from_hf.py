"""Training starts from a saved transformers Mixtral (``checkpoint.init_from_hf``), sharded on load.

A random tiny ``MixtralForCausalLM`` is saved with ``save_pretrained``. The real trainer then runs

- on 1 rank, 3 steps from that directory;
- on 4 ranks in TP2 EP2 (ETP1), 2 steps from that directory, saving a checkpoint at step 2, then the
  same command with ``train.steps=3``: it resumes from its own checkpoint (``init_from_hf`` ignored);
- on 4 ranks in TP2 EP2, 1 step from the ``tools/convert_hf.py import`` file of the same model.

The first step's LM loss equals transformers' loss on the same global batch (relative 1e-5), the two
layouts agree at every step (loss 1e-5, grad norm 1e-4), and each of the 4 ranks reads exactly the
elements of the slices it holds (fewer than the model's), while the 1-rank run reads them all.
"""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from folding.data.build import build_data
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
from tests.distributed.test_checkpoint_reshard import _run
from tests.hf_checks import TRAINABLE_MIXTRAL, TRAINABLE_MIXTRAL_PRESET, randomized
from tests.optional import require

HF, MODEL = TRAINABLE_MIXTRAL, TRAINABLE_MIXTRAL_PRESET
TRAIN = dict(global_batch_size=8, micro_batch_size=1, seq_length=16)
TP2_EP2 = dict(tp=2, ep=2, etp=1)


def _job(parallel, steps, source, ckpt_dir=None):
    return JobConfig(
        model=get_preset("mixtral_tiny", **MODEL),
        parallel=ParallelConfig(**parallel),
        train=TrainConfig(steps=steps, eval_interval=0, seed=11, **TRAIN),
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=1, decay_steps=3, clip_grad=1.0, weight_decay=0.01),
        data=DataConfig(),
        checkpoint=CheckpointConfig(dir=ckpt_dir, init_from_hf=source),
        logging=LoggingConfig(metrics_file="metrics.jsonl", console=False, wandb=WandbConfig(mode="disabled")),
    )


def _train(parallel, steps, source, run_dir, ckpt_dir=None):
    """One run through the trainer; the elements this rank read from safetensors, its own and the model's."""
    from folding.model.hf import weights as hf

    real, read = hf._Reader.read, [0]

    def counting(self, name, shape, index):
        t = real(self, name, shape, index)
        read[0] += t.numel()
        return t

    hf._Reader.read = counting
    try:
        hist, resumed, params, _ = _run(_job(parallel, steps, source, ckpt_dir), run_dir)
    finally:
        hf._Reader.read = real
    return dict(
        hist=hist,
        resumed=resumed,
        read=read[0],
        local=sum(t.numel() for _, _, t in params.values()),
        full=sum(math.prod(shape) for shape, _, _ in params.values()),
    )


def _folded_runs(hf_dir, pt_file, root):
    ck = os.path.join(root, "ck")
    first = _train(TP2_EP2, 2, hf_dir, os.path.join(root, "run4"), ck)
    again = _train(TP2_EP2, 3, hf_dir, os.path.join(root, "run4"), ck)  # restarted: resumes at step 2
    from_pt = _train(TP2_EP2, 1, pt_file, os.path.join(root, "run4pt"))
    return dict(first=first, again=again, from_pt=from_pt)


def _transformers_loss(model) -> float:
    """transformers' mean LM loss over the trainer's first global batch (the data pipeline's labels
    and loss mask, every micro-batch of the step)."""
    data = build_data(DataConfig(), dp_rank=0, dp_size=1, **TRAIN)
    mbs = [next(data.train) for _ in range(TRAIN["global_batch_size"] // TRAIN["micro_batch_size"])]
    tokens, labels, mask = (torch.cat([mb[k] for mb in mbs]) for k in ("tokens", "labels", "loss_mask"))
    with torch.no_grad():
        logits = model(tokens).logits
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return float((ce * mask.reshape(-1)).sum() / mask.sum())


def _close(a, b, rel):
    return abs(a - b) <= rel * abs(b)


def test_train_from_transformers_mixtral_in_two_layouts(ranks, tmp_path):
    transformers = require("transformers")
    from tools import convert_hf

    hf_model = randomized(transformers.MixtralForCausalLM(transformers.MixtralConfig(**HF))).eval()
    hf_dir, pt_file = str(tmp_path / "hf"), str(tmp_path / "engine.pt")
    hf_model.save_pretrained(hf_dir)
    assert convert_hf.main(["import", hf_dir, pt_file]) == 0
    want = _transformers_loss(hf_model)

    one = ranks(1).run(_train, {}, 3, hf_dir, str(tmp_path / "run1"))[0]
    folded = ranks(4).run(_folded_runs, hf_dir, pt_file, str(tmp_path))

    print(
        f"transformers {want:.7f}; 1 rank {[round(h[1], 7) for h in one['hist']]}; TP2 EP2 "
        f"{[round(h[1], 7) for h in folded[0]['first']['hist'] + folded[0]['again']['hist']]}; from .pt "
        f"{folded[0]['from_pt']['hist'][0][1]:.7f}; elements read per rank {[r['first']['read'] for r in folded]} "
        f"of {folded[0]['first']['full']}"
    )
    # step 1: the weights are transformers' (the loss is computed before the first update)
    assert [h[0] for h in one["hist"]] == [1, 2, 3]
    assert _close(one["hist"][0][1], want, 1e-5), (one["hist"][0], want)
    for r in folded:
        assert [h[0] for h in r["first"]["hist"]] == [1, 2]
        assert _close(r["first"]["hist"][0][1], want, 1e-5), (r["first"]["hist"][0], want)
        assert _close(r["from_pt"]["hist"][0][1], want, 1e-5), (r["from_pt"]["hist"][0], want)
        # the two layouts agree on every step, the one after the resume included
        for (step, loss, norm, lr), (s1, l1, n1, lr1) in zip(r["first"]["hist"] + r["again"]["hist"], one["hist"]):
            assert step == s1 and _close(loss, l1, 1e-5) and _close(norm, n1, 1e-4) and lr == pytest.approx(lr1), (
                step,
                loss,
                l1,
                norm,
                n1,
            )
        # a restart resumes from the run's own checkpoint, not from the Hugging Face weights
        assert r["first"]["resumed"] is None
        assert r["again"]["resumed"].endswith("step_00000002") and [h[0] for h in r["again"]["hist"]] == [3]
        assert r["again"]["read"] == 0
        # sharded on load: each rank read exactly its slices, a fraction of the model
        assert r["first"]["read"] == r["first"]["local"] < r["first"]["full"], r["first"]
    assert one["read"] == one["local"] == one["full"]
    assert len({r["first"]["local"] for r in folded}) == 1  # TP2 EP2: every rank holds the same share
    runs = [json.loads(line) for line in open(tmp_path / "run4" / "metrics.jsonl") if '"kind": "run"' in line]
    assert [r["init_from_hf"] for r in runs] == [hf_dir, None]


def _train_from(source, root):
    ck = os.path.join(root, "ck")
    _train(dict(ep=2, etp=1), 1, source, os.path.join(root, "run"), ck)  # fresh from the source
    _train(dict(ep=2, etp=1), 2, source, os.path.join(root, "run"), ck)  # resumed: the source goes on


def test_export_keeps_the_source_config_fields(ranks, tmp_path):
    """A run started from Hugging Face weights (and resumed once) exports a config.json that keeps every
    field of the source's the engine does not write, and its initializer_range, unchanged."""
    transformers = require("transformers")
    from tools import convert_hf

    hf_dir = str(tmp_path / "src")
    config = transformers.MixtralConfig(**HF, initializer_range=0.05, bos_token_id=5, note_of_the_source="kept")
    randomized(transformers.MixtralForCausalLM(config)).save_pretrained(hf_dir)
    source = json.load(open(os.path.join(hf_dir, "config.json")))
    ranks(2).run(_train_from, hf_dir, str(tmp_path))
    out = str(tmp_path / "hf_out")
    assert convert_hf.main(["export", "--checkpoint", str(tmp_path / "ck"), "--out", out]) == 0
    exported = json.load(open(os.path.join(out, "config.json")))
    assert exported["max_position_embeddings"] == source["max_position_embeddings"] == 512
    assert exported["initializer_range"] == 0.05 and exported["note_of_the_source"] == "kept"
    assert exported["bos_token_id"] == 5
    changed = {k for k in source if exported.get(k) != source[k]}
    diff = {k: (source[k], exported.get(k)) for k in changed}
    # what may change: the weights' dtype and writer, and the run's own aux loss (moe.aux_loss_coeff, a
    # training setting the engine writes as the run used it: this job's preset sets one of its own); the
    # source's output_router_logits stays
    own = {"torch_dtype", "dtype", "transformers_version", "router_aux_loss_coef"}
    assert changed <= own, diff
    assert exported["output_router_logits"] is source["output_router_logits"] is False
    model = transformers.AutoModelForCausalLM.from_pretrained(out)  # and it loads
    assert model.config.initializer_range == 0.05
