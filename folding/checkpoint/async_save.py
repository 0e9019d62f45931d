"""Asynchronous checkpoint saves (``checkpoint.async_save``): training goes on while DCP writes.

One save of step N, on every rank:

1. :meth:`AsyncSaver.start` (the only part the training loop waits for): the checkpoint's
   ``begin_save(copy=True)`` copies this rank's blocks and optimizer state to host memory, writes its
   RNG and FP8 files and captures ``meta.json``; the copy goes to
   ``torch.distributed.checkpoint.async_save``, whose thread plans and writes it into
   ``DIR/step_<N>.tmp-<nonce>``. That thread's collectives run on a gloo group of their own, so they
   never interleave with the training's collectives (on NCCL, too, they stay on the host).
2. Training continues. Each step's world all-reduce carries one more number, whether this rank's
   write is still running (:meth:`AsyncSaver.writing`), so every rank learns at the same step that
   every rank's write has finished; then :meth:`AsyncSaver.finish` collects the result (an error of
   the write is raised here, on every rank) and rank 0 publishes the checkpoint exactly as a
   synchronous save does (``meta.json``, ``COMPLETE``, one rename). Until then only the temporary
   directory exists: a crash leaves the previous complete checkpoint the latest.
3. The next save, the last step's save and a stop request wait for the pending write first
   (:meth:`AsyncSaver.finish` blocks until it is done), so at most one save is in flight.

DCP's own staging is bypassed (the state dict is already a host copy; its default would deep-copy
the blocks again). While a save is in flight a rank holds one extra host copy of its model and
optimizer state.

Usage::

    saver = AsyncSaver(timeout_s=job.train.collective_timeout_s)      # collective: creates its group
    saver.start(ckpt_dir, step=k, chunks=chunks, optimizer=opt, data=data, job=job, layout=layout)
    ...                                                              # steps; all-reduce saver.writing()
    save = saver.finish()                                            # every rank: published on rank 0
    saver.close()
"""

from __future__ import annotations

import datetime
from concurrent.futures import Future
from typing import Optional

import torch.distributed as dist

from . import blocks
from .save import SaveInProgress, begin_save, publish_save


class _AlreadyStaged:
    """DCP staging that keeps the state dict as given (``begin_save(copy=True)`` made it a host copy): an
    ``AsyncStager`` (a protocol of ``torch.distributed.checkpoint.staging``, implemented here without
    importing it, so that DCP is imported only when a save starts)."""

    @property
    def should_synchronize_after_execute(self) -> bool:
        """Nothing to wait for after the write thread starts (the state dict is already a host copy)."""
        return False

    def synchronize_staging(self) -> None:
        """Nothing to wait for."""

    def stage(self, state_dict):
        """The state dict itself."""
        return state_dict

    def close(self) -> None:
        """Nothing to release."""


class AsyncSaver:
    """A run's asynchronous saves: at most one in flight, published once every rank has written it.

    Args:
        timeout_s: timeout of the save thread's collectives (``train.collective_timeout_s``).
    """

    def __init__(self, *, timeout_s: float):
        """Create the save thread's gloo group (collective over the world)."""
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.pending: Optional[SaveInProgress] = None
        """The save being written, or ``None``."""
        self._future: Optional[Future] = None

    def start(self, ckpt_dir: str, **save_args) -> None:
        """Wait for a pending save and publish it, then start saving (collective over the world).
        ``save_args``: the keyword arguments of ``begin_save`` (step, chunks, optimizer, data, job,
        layout, run_dir)."""
        if self.pending is not None:
            self.finish()
        import torch.distributed.checkpoint as dcp  # on first use: see folding.checkpoint.blocks

        save = begin_save(ckpt_dir, copy=True, **save_args)
        self._future = dcp.async_save(
            save.state_dict,
            checkpoint_id=save.tmp,
            planner=blocks.BlockSavePlanner(),
            process_group=self.group,
            async_stager=_AlreadyStaged(),
        )
        self.pending = save

    def writing(self) -> bool:
        """Whether this rank's write of the pending save is still running (local; no collective)."""
        return self.pending is not None and not self._future.done()

    def finish(self) -> SaveInProgress:
        """Wait for the pending save's write (every rank calls it at the same step), raise its error if
        it failed, and publish it on rank 0; return it."""
        save, future = self.pending, self._future
        self.pending = self._future = None
        future.result()  # DCP's last step gathers every rank's write results: done here means done everywhere
        if dist.get_rank() == 0:
            publish_save(save)
        save.state_dict = {}  # the host copy is no longer needed
        return save

    def close(self) -> None:
        """Release the save thread's group (after :meth:`finish`; nothing may be pending)."""
        if self.pending is not None:
            raise RuntimeError("AsyncSaver.close: a save is still pending; finish() it first")
        dist.destroy_process_group(self.group)
