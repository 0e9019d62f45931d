"""Asynchronous saves (``checkpoint.async_save``): training goes on while a checkpoint is written, and
a rank killed during the write leaves the previous complete checkpoint as the one to resume from.

Run A (2 ranks, EP2, saving every 2 steps) has the write of step 4's checkpoint held back on every
rank; rank 1 reaches step 5 (training went on: its own write of step 4 is still in flight) and
SIGKILLs itself. Step 2's checkpoint is then complete and step 4's is only a temporary directory.
Run B, the same command on fresh ranks, resumes from step 2, trains steps 3-6 with the losses and grad
norms of an uninterrupted run, and publishes steps 4 and 6 (the left-over directory removed).
"""

import json
import os
import signal
import threading
import time

import pytest
import torch.distributed as dist

from folding.checkpoint import load as ckpt
from folding.job.config import CheckpointConfig
from folding.testing import RankFailure
from tests.distributed.test_checkpoint_reshard import _job, _run

WORLD = 2
LAYOUT = dict(ep=2, etp=1)
HELD_STEP = 4


def _async_job(steps, ckpt_dir=None):
    job = _job(LAYOUT, False, steps=steps)
    if ckpt_dir:
        job.checkpoint = CheckpointConfig(dir=ckpt_dir, save_interval=2, async_save=True)
    return job


def _kill_during_async_save(root):
    from torch.distributed.checkpoint import FileSystemWriter

    from folding.training import trainer

    real_write, real_count = FileSystemWriter.write_data, trainer.global_token_count
    writing, steps = threading.Event(), []

    def held_write(self, plan, planner):  # the save thread of step 4 never gets to write
        if f"step_{HELD_STEP:08d}.tmp-" in str(self.path):
            writing.set()
            time.sleep(600)
        return real_write(self, plan, planner)

    def count_then_kill(*args, **kwargs):  # called once per step, before its all-reduce
        steps.append(1)
        if len(steps) == HELD_STEP + 1 and dist.get_rank() == 1:
            if writing.wait(60):  # step 5 started while this rank's write of step 4 is in flight
                os.kill(os.getpid(), signal.SIGKILL)
        return real_count(*args, **kwargs)

    FileSystemWriter.write_data, trainer.global_token_count = held_write, count_then_kill
    try:
        _run(_async_job(6, os.path.join(root, "ck")), os.path.join(root, "a"))
    finally:
        FileSystemWriter.write_data, trainer.global_token_count = real_write, real_count
    return "rank 1 was never killed"


def _reference_then_resume(root):
    ref = _run(_async_job(6), os.path.join(root, "ref"))[0]
    hist, resumed, _, _ = _run(_async_job(6, os.path.join(root, "ck")), os.path.join(root, "b"))
    return dict(ref=ref, hist=hist, resumed=resumed)


def test_rank_killed_during_async_save_resumes_from_previous_checkpoint(ranks, tmp_path):
    d = str(tmp_path / "ck")
    with pytest.raises(RankFailure, match=r"rank\(?s?\)? \[1\] (of 2 died|did not answer)"):  # rank 1 is gone
        ranks(WORLD).run(_kill_during_async_save, str(tmp_path))
    listing = sorted(os.listdir(d))
    assert ckpt.latest_complete(d).endswith("step_00000002"), listing
    assert [n for n in listing if n.startswith("step_00000004")][0].startswith("step_00000004.tmp-"), listing

    out = ranks(WORLD).run(_reference_then_resume, str(tmp_path))[0]
    assert out["resumed"].endswith("step_00000002")
    assert [h[0] for h in out["hist"]] == [3, 4, 5, 6]
    for (step, loss, norm, _), ref in zip(out["hist"], out["ref"][2:]):
        assert step == ref[0]
        assert abs(loss - ref[1]) <= 1e-5 * abs(ref[1]), (step, loss, ref)
        assert abs(norm - ref[2]) <= 1e-4 * abs(ref[2]), (step, norm, ref)
    assert sorted(os.listdir(d)) == ["step_00000002", "step_00000004", "step_00000006"]
    # the save of step 4 was published after a later step's record: training went on while it was written
    records = [json.loads(line) for line in open(tmp_path / "b" / "metrics.jsonl")]
    order = [(r["kind"], r["step"], r.get("published")) for r in records if r["kind"] in ("train", "checkpoint")]
    started, published = order.index(("checkpoint", 4, False)), order.index(("checkpoint", 4, True))
    assert order[started - 1] == ("train", 4, None) and ("train", 5, None) in order[started:published], order
    assert order[-1] == ("checkpoint", 6, True), order  # the last step's save is waited for
