"""Saves are atomic, resumable after a crash, and exportable to Hugging Face.

- A crash in the middle of a save (the tensors written, the checkpoint not yet published) leaves the
  previous checkpoint as the latest complete one; the next run resumes from it, ignores and removes
  the partial directory, and trains like an uninterrupted run.
- A checkpoint of a folded layout (TP2 PP2 EP2) exports to HF safetensors that ``transformers``
  loads, with the weights the ranks trained and the logits of the engine.
"""

import os
import signal

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from folding.checkpoint import load as ckpt
from tests.distributed.test_checkpoint_reshard import _assemble, _job, _run
from tests.optional import require

WORLD = 4


class _Crash(RuntimeError):
    pass


def _crash_then_resume(root):
    d = os.path.join(root, "ck")
    ref = _run(_job(dict(tp=2, ep=2, etp=1), False, steps=3), root)[0]
    _run(_job(dict(tp=2, ep=2, etp=1), False, steps=2, ckpt_dir=d), root)  # saves step 2
    real_save = dcp.save

    def save_then_crash(*args, **kwargs):  # every rank dies after writing its data
        real_save(*args, **kwargs)
        raise _Crash("injected crash during the save")

    dcp.save = save_then_crash
    try:
        _run(_job(dict(pp=2, ep=2, etp=1), True, steps=3, ckpt_dir=d), root)
        crashed = False
    except _Crash:
        crashed = True
    finally:
        dcp.save = real_save
    dist.barrier()
    listing = sorted(os.listdir(d))
    latest = ckpt.latest_complete(d)
    dist.barrier()
    hist, resumed, _, _ = _run(_job(dict(pp=2, ep=2, etp=1), True, steps=3, ckpt_dir=d), root)
    return dict(
        ref=ref,
        crashed=crashed,
        listing=listing,
        latest=latest,
        hist=hist,
        resumed=resumed,
        after=sorted(os.listdir(d)),
    )


def test_crash_during_save_leaves_previous_checkpoint(ranks, tmp_path):
    out = ranks(WORLD).run(_crash_then_resume, str(tmp_path))[0]
    assert out["crashed"]
    partial = [n for n in out["listing"] if n.startswith("step_00000003")]
    assert len(partial) == 1 and ".tmp-" in partial[0], out["listing"]  # the partial save is there...
    assert out["latest"].endswith("step_00000002")  # ...and ignored
    assert out["resumed"].endswith("step_00000002")
    assert [h[0] for h in out["hist"]] == [3]
    step, loss, norm, _ = out["hist"][0]
    assert abs(loss - out["ref"][2][1]) <= 1e-5 * abs(out["ref"][2][1]), (loss, out["ref"][2])
    assert abs(norm - out["ref"][2][2]) <= 1e-4 * abs(out["ref"][2][2])
    assert out["after"] == ["step_00000002", "step_00000003"], out["after"]  # partial removed by the next save


def _sigterm_then_resume(root):
    from folding.training import trainer

    d = os.path.join(root, "ck")
    ref = _run(_job(dict(tp=2, ep=2, etp=1), False, steps=4), root)[0]
    real_count, calls = trainer.global_token_count, []

    def count_and_signal(*args, **kwargs):  # rank 1 receives SIGTERM during step 2
        calls.append(1)
        if len(calls) == 2 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_count(*args, **kwargs)

    trainer.global_token_count = count_and_signal
    try:
        stopped = _run(_job(dict(pp=2, ep=2, etp=1), False, steps=4, ckpt_dir=d), root)[0]
    finally:
        trainer.global_token_count = real_count
    complete = [s for s, _ in ckpt.list_complete(d)]
    dist.barrier()
    resumed = _run(_job(dict(tp=2, ep=2, etp=1), True, steps=4, ckpt_dir=d), root)[0]
    return dict(ref=ref, stopped=stopped, complete=complete, resumed=resumed)


def test_sigterm_saves_and_stops_then_resumes(ranks, tmp_path):
    for out in ranks(WORLD).run(_sigterm_then_resume, str(tmp_path)):
        assert [h[0] for h in out["stopped"]] == [1, 2]  # every rank stopped after step 2
        assert out["complete"] == [2]  # ...with a checkpoint of step 2
        assert [h[0] for h in out["resumed"]] == [3, 4]
        for (step, loss, norm, _), ref in zip(out["stopped"] + out["resumed"], out["ref"]):
            assert abs(loss - ref[1]) <= 1e-5 * abs(ref[1]), (step, loss, ref)


def _train_for_export(root):
    d = os.path.join(root, "ck")
    _, _, params, _ = _run(_job(dict(tp=2, pp=2, ep=2, etp=1), True, steps=2, ckpt_dir=d), root)
    return params


def test_export_after_training_loads_in_transformers(ranks, tmp_path):
    transformers = require("transformers")
    from tools import convert_hf as convert

    trained = _assemble(ranks(WORLD).run(_train_for_export, str(tmp_path)))
    out = str(tmp_path / "hf")
    assert convert.main(["export", "--checkpoint", str(tmp_path / "ck"), "--out", out]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    # the engine, 1 rank, from the same checkpoint: it holds exactly the weights the ranks trained
    from folding.model.config import ModelConfig
    from folding.model.transformer import MoETransformer

    path = ckpt.latest_complete(str(tmp_path / "ck"))
    meta = ckpt.read_meta(path)
    cfg = ModelConfig.from_dict(meta["model"])
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with convert.single_process_world():
        engine = MoETransformer(cfg, initialize=False)
        ckpt.load_full_model(path, engine)
        for name, p in engine.named_parameters():
            torch.testing.assert_close(p.detach(), trained[name].reshape(p.shape), rtol=0, atol=0, msg=name)
        engine.eval()
        with torch.no_grad():
            want = engine(tokens)
    with torch.no_grad():
        got = hf(tokens).logits
        # the Python API's way to the logits of a checkpoint, without exporting it (no process group)
        api = ckpt.load_model(str(tmp_path / "ck"))(tokens)
    assert want.shape == got.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(api, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="neither a complete checkpoint nor a directory holding one"):
        ckpt.load_model(str(tmp_path))
