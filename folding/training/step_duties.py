"""What the training loop does at a step boundary after the update: evaluation, checkpoints, the stop report.

Each function takes the loop's run state (``folding.training.trainer``'s ``_Run``: the job, the model
chunks, the optimizer, the data, the metrics sink, the asynchronous saver) and the 1-based step just
taken. Called by :func:`folding.training.trainer.train` in this order: :func:`evaluate_if_due`,
:func:`checkpoint_if_due`; :func:`report_stop` when a signal stopped the run.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from ..checkpoint.load import step_dir_name
from ..checkpoint.save import save_checkpoint
from .evaluate import evaluate


def evaluate_if_due(run, step: int) -> None:
    """Every ``train.eval_interval`` steps and at the last one (with validation data): the ``eval``
    record, and ``eval_lm_loss`` in the step's history."""
    t, valid = run.job.train, run.prep.data.valid
    if not (t.eval_interval and valid is not None and (step % t.eval_interval == 0 or step == t.steps)):
        return
    ev = evaluate(
        run.chunks,
        valid,
        parallel_state=run.ps,
        num_microbatches=run.num_microbatches,
        eval_steps=t.eval_steps,
        device=run.device,
    )
    run.history[-1]["eval_lm_loss"] = ev["lm_loss"]
    if run.sink:
        run.sink.log({"kind": "eval", "step": step, **ev})


def checkpoint_if_due(run, step: int) -> None:
    """With ``checkpoint.dir``: publish an asynchronous save that every rank has written, then save
    every ``checkpoint.save_interval`` steps, at the last step and when the run stops (with
    ``checkpoint.async_save`` the loop only waits for the host copy, except at the last step and on a
    stop, where the write is waited for)."""
    ck = run.job.checkpoint
    if run.save_written:
        published(run, run.saver.finish(), blocked_s=None)
        run.save_written = False
    due = run.stopped or step == run.job.train.steps or (ck.save_interval and step % ck.save_interval == 0)
    if not (ck.dir and due):
        return
    t0 = time.perf_counter()
    save_args = dict(
        step=step,
        chunks=run.chunks,
        optimizer=run.optimizer,
        data=run.prep.data,
        job=run.job,
        layout=run.prep.layout,
        run_dir=run.run_dir,
        hf_source=run.prep.hf_source_config,
    )
    if run.saver is None:
        save_checkpoint(ck.dir, **save_args)
        published(run, step, blocked_s=time.perf_counter() - t0)
        return
    if run.saver.pending is not None:  # the previous write is still running: wait for it
        published(run, run.saver.finish(), blocked_s=None)
    run.saver.start(ck.dir, **save_args)
    if run.stopped or step == run.job.train.steps:
        run.saver.finish()
    published(run, step, blocked_s=time.perf_counter() - t0, pending=run.saver.pending is not None)


def published(run, save, *, blocked_s: Optional[float], pending: bool = False) -> None:
    """Rank 0 logs the ``checkpoint`` record of step ``save`` (a step or an asynchronous save):
    ``blocked_s`` the seconds the loop waited for it (``None`` for a background write finishing),
    ``pending`` whether its write goes on in the background (published later, in a second record)."""
    step = save if isinstance(save, int) else save.step
    if not pending:
        run.saved_at = step
    if run.sink:
        path = os.path.join(os.path.abspath(run.job.checkpoint.dir), step_dir_name(step))
        record = {"kind": "checkpoint", "step": step, "path": path, "published": not pending}
        if blocked_s is not None:
            record["blocked_s"] = blocked_s
        run.sink.log(record)


def report_stop(run, step: int) -> None:
    """Rank 0 says that a signal stopped the run after ``step`` and whether a checkpoint was saved."""
    if run.rank != 0:
        return
    line = f"stop requested by a signal: stopped after step {step}" + (
        ", checkpoint saved" if run.saved_at == step else ", no checkpoint (checkpoint.dir is unset)"
    )
    (run.run_log.echo if run.run_log else print)(line)
