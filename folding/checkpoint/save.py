"""Saving a checkpoint: the temporary directory, the tensors, the metadata, atomic publication, pruning.

A save is collective over the world. :func:`begin_save` agrees on ``DIR/step_<N>.tmp-<nonce>``
(rank 0 chooses and broadcasts it, and removes left-over temporary directories of crashed saves),
builds this rank's DCP state dict of blocks (:mod:`folding.checkpoint.blocks`), writes this
rank's RNG and FP8 files and captures ``meta.json`` as of the step. The tensors are then written by
``torch.distributed.checkpoint`` into the temporary directory, and once every rank's write has
finished, :func:`publish_save` (rank 0) writes ``meta.json`` and ``COMPLETE``, fsyncs, and publishes
with one ``rename`` to ``DIR/step_<N>``, then prunes to ``checkpoint.keep_last``. Until that rename,
nothing a loader looks at has changed: a crash at any point leaves the previous checkpoint the latest.

:func:`save_checkpoint` does all of it before returning; :mod:`folding.checkpoint.async_save`
writes in the background (``begin_save(copy=True)``: the state dict is a host copy) and publishes
later. What a checkpoint holds and how it is loaded: :mod:`folding.checkpoint.load`.

Usage::

    path = save_checkpoint(job.checkpoint.dir, step=k, chunks=chunks, optimizer=opt, data=data, job=job,
                           layout=layout)
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..job.config import plain_tree as _plain
from . import blocks
from .blocks import Block
from .load import FORMAT, MARKER, META, _fp8_states, _model_blocks, _optim_blocks, list_complete, step_dir_name

_TMP = re.compile(r"^step_\d{8}\.tmp-")


def _rng_state() -> Dict[str, torch.Tensor]:
    st = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: str, final: str) -> None:
    """Rank 0: marker, sync, one rename (an older copy of the same step is moved aside first)."""
    with open(os.path.join(tmp, MARKER), "w") as f:
        f.write("ok\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    old = None
    if os.path.exists(final):
        old = f"{tmp}-replaced"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))
    if old:
        shutil.rmtree(old, ignore_errors=True)


def prune(ckpt_dir: str, keep_last: Optional[int], *, keep: Sequence[str] = ()) -> List[str]:
    """Delete complete checkpoints older than the newest ``keep_last`` (never one in ``keep``) and
    left-over ``step_*.tmp-*`` directories; return the removed paths. Other files are left alone."""
    removed = []
    if keep_last:
        for _, path in list_complete(ckpt_dir)[:-keep_last]:
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def _remove_stale_tmp(ckpt_dir: str, current: str) -> None:
    for name in os.listdir(ckpt_dir):
        path = os.path.join(ckpt_dir, name)
        if _TMP.match(name) and path != current and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)


@dataclasses.dataclass
class SaveInProgress:
    """A save whose directory is agreed and whose tensors are to be written (:func:`begin_save`)."""

    step: int
    tmp: str
    """``DIR/step_<N>.tmp-<nonce>``: where every rank writes."""
    final: str
    """``DIR/step_<N>``: the name it is published under."""
    state_dict: Dict[str, Any]
    """This rank's DCP state dict (:class:`Block` values)."""
    meta: Optional[Dict[str, Any]]
    """``meta.json`` as of the step (rank 0; ``None`` elsewhere)."""
    keep_last: Optional[int]
    """``checkpoint.keep_last``, applied when it is published."""


def _host_copy(block: Block) -> Block:
    """``block`` with its values copied to host memory (later updates of the live tensor do not reach it)."""
    return Block(block.local.detach().to("cpu", copy=True), block.full_shape, block.offsets)


def begin_save(
    ckpt_dir: str,
    *,
    step: int,
    chunks,
    optimizer,
    data,
    job,
    layout,
    run_dir: Optional[str] = None,
    copy: bool = False,
    hf_source: Optional[Dict[str, Any]] = None,
) -> SaveInProgress:
    """Start saving step ``step`` (collective over the world): agree on the temporary directory, build
    this rank's state dict (copied to host memory when ``copy``, so that training may go on while it
    is written), write this rank's RNG and FP8 files, and capture the metadata. The tensors are then
    written by ``dcp.save`` or ``dcp.async_save`` into ``tmp``, and :func:`publish_save` publishes.

    The optimizer state is exported parameter-shaped (an all-gather inside each ZeRO-1 group when
    ``optim.distributed``); DCP then writes each distinct block once.
    """
    rank = dist.get_rank()
    ckpt_dir = os.path.abspath(ckpt_dir)
    final = os.path.join(ckpt_dir, step_dir_name(step))
    box = [f"{final}.tmp-{os.getpid()}-{time.time_ns()}" if rank == 0 else None]
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        _remove_stale_tmp(ckpt_dir, box[0])
    dist.broadcast_object_list(box, src=0)
    tmp = box[0]
    states = optimizer.param_state()
    model = _model_blocks(chunks)
    sd: Dict[str, Any] = dict(model)
    sd.update(_optim_blocks(chunks, optimizer, model, states))
    if copy:
        sd = {k: _host_copy(b) for k, b in sd.items()}
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{rank}.pt"))
    fp8 = _fp8_states(chunks)
    if fp8:
        os.makedirs(os.path.join(tmp, "fp8"), exist_ok=True)
        torch.save(fp8, os.path.join(tmp, "fp8", f"rank_{rank}.pt"))
    meta = None
    if rank == 0:
        meta = {
            "format": FORMAT,
            "step": int(step),
            "adam_updates": int(optimizer.updates),
            "data": data.state_dict() if data is not None else None,
            "tokenizer": job.data.tokenizer,
            "model": _plain(dataclasses.asdict(job.model)),
            "optim": _plain(dataclasses.asdict(job.optim)),
            "layout": layout.describe(),
            "world_size": dist.get_world_size(),
            "precision": job.train.precision,
            "master_weights": any(k.endswith("/master") for k in sd),
            "run_dir": os.path.abspath(run_dir) if run_dir else None,
            "hf_source_config": hf_source,
        }
    return SaveInProgress(
        step=int(step), tmp=tmp, final=final, state_dict=sd, meta=meta, keep_last=job.checkpoint.keep_last
    )


def publish_save(save: SaveInProgress) -> str:
    """Rank 0, once every rank's tensors and files are in ``save.tmp``: write ``meta.json`` and the
    marker, publish with one rename, prune older checkpoints; return the published path."""
    with open(os.path.join(save.tmp, META), "w", encoding="utf-8") as f:
        json.dump(save.meta, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _publish(save.tmp, save.final)
    prune(os.path.dirname(save.final), save.keep_last, keep=(save.final,))
    return save.final


def save_checkpoint(
    ckpt_dir: str,
    *,
    step: int,
    chunks,
    optimizer,
    data,
    job,
    layout,
    run_dir: Optional[str] = None,
    hf_source: Optional[Dict[str, Any]] = None,
) -> str:
    """Save step ``step`` to ``ckpt_dir/step_<N>`` and publish it (collective over the world; returns
    the path). ``run_dir`` (the run directory, recorded in the metadata) is where a resumed run
    continues; ``hf_source`` (the ``config.json`` of the Hugging Face weights the run started from)
    is recorded as ``hf_source_config`` for the export. (``checkpoint.async_save``:
    :mod:`folding.checkpoint.async_save`.)"""
    save = begin_save(
        ckpt_dir,
        step=step,
        chunks=chunks,
        optimizer=optimizer,
        data=data,
        job=job,
        layout=layout,
        run_dir=run_dir,
        hf_source=hf_source,
    )
    import torch.distributed.checkpoint as dcp  # on first use: see folding.checkpoint.blocks

    dcp.save(save.state_dict, checkpoint_id=save.tmp, planner=blocks.BlockSavePlanner())
    dist.barrier()
    if dist.get_rank() == 0:
        publish_save(save)
    dist.barrier()
    return save.final
