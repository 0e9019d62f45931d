"""Reading a Megatron-Core ``torch_dist`` checkpoint on one process, whatever TP/PP/EP saved it.

A ``torch_dist`` checkpoint (Megatron-Core's ``dist_checkpointing.save``; Megatron-LM's
``--ckpt-format torch_dist``) is a ``torch.distributed.checkpoint`` (DCP) store: ``.metadata``,
``__<rank>_<n>.distcp`` files, ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``) and
``common.pt``. Its keys are Megatron's sharded-state-dict keys and every tensor is recorded by its
*global* (unsharded) shape, so one process reads any slice of it without knowing the layout that
wrote it. Megatron-LM puts the store in ``DIR/iter_<7 digits>/`` (``DIR/release/`` for a release)
beside ``DIR/latest_checkpointed_iteration.txt``; either directory may be given.

:class:`MegatronStore` lists the keys with their global shapes (from ``.metadata`` alone) and reads
one tensor, or the sub-tensor at fixed leading indices (one layer of a tensor stacked over layers,
one expert of one layer), through DCP's default load planner without a process group: only the
saved chunks that overlap the requested block are read (:class:`folding.checkpoint.blocks.Block`).

Usage::

    store = MegatronStore("ckpt/iter_0000100")
    store.shapes["decoder.layers.self_attention.linear_qkv.weight"]   # (L, rows, H)
    w = store.read("decoder.layers.self_attention.linear_qkv.weight", (3,))   # layer 3: (rows, H)
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Dict, Optional, Sequence, Tuple

import torch

from ..model.hf.errors import CheckpointError
from . import blocks
from .blocks import Block

TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron-LM's file naming the latest iteration (or ``release``) under a checkpoint directory."""
_ITER = re.compile(r"^iter_(\d{7})$")


def resolve_megatron_dir(path: str) -> Tuple[str, int]:
    """``(store directory, iteration)`` of the Megatron checkpoint at ``path``: a ``torch_dist`` store
    itself (``iter_<N>``, ``release`` or any directory holding ``.metadata``), or a directory with
    ``latest_checkpointed_iteration.txt`` (its latest iteration). The iteration is 0 when the name does
    not say it. Raises :class:`CheckpointError` naming ``path`` when it is neither."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise CheckpointError(f"Megatron checkpoint {path} is not a directory")
    if not os.path.isfile(os.path.join(path, ".metadata")) and os.path.isfile(os.path.join(path, TRACKER)):
        with open(os.path.join(path, TRACKER), encoding="utf-8") as f:
            latest = f.read().strip()
        sub = "release" if latest == "release" else f"iter_{int(latest):07d}"
        path = os.path.join(path, sub)
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(
            f"{path} is not a Megatron-Core torch_dist checkpoint (no .metadata, no {TRACKER}); give the "
            "directory Megatron saved into (--save) or one of its iter_<N> directories"
        )
    backend = _sharded_backend(path)
    if backend not in (None, "torch_dist"):
        raise CheckpointError(
            f"{path} is a Megatron {backend!r} checkpoint; only torch_dist is read: convert it with Megatron-LM's "
            "--ckpt-convert-format torch_dist"
        )
    m = _ITER.match(os.path.basename(path))
    return path, int(m.group(1)) if m else 0


def _sharded_backend(path: str) -> Optional[str]:
    f = os.path.join(path, "metadata.json")
    if not os.path.isfile(f):
        return None
    with open(f, encoding="utf-8") as fh:
        return json.load(fh).get("sharded_backend")


class MegatronStore:
    """The tensors of a Megatron-Core ``torch_dist`` store, by key, read on one process.

    Args:
        path: the store or the directory holding ``latest_checkpointed_iteration.txt``
            (:func:`resolve_megatron_dir`).
    """

    def __init__(self, path: str):
        """Read ``.metadata`` (no tensor is read)."""
        import torch.distributed.checkpoint as dcp  # on first use: see folding.checkpoint.blocks
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path, self.iteration = resolve_megatron_dir(path)
        md = dcp.FileSystemReader(self.path).read_metadata().state_dict_metadata
        self.shapes: Dict[str, Tuple[int, ...]] = {}
        """Every tensor key with its global shape."""
        self.dtypes: Dict[str, torch.dtype] = {}
        """Every tensor key with its saved dtype."""
        self.objects = sorted(k for k, v in md.items() if not isinstance(v, TensorStorageMetadata))
        """The keys of non-tensor entries (``_extra_state`` bytes, optimizer step counts, ...)."""
        for k, v in md.items():
            if isinstance(v, TensorStorageMetadata):
                self.shapes[k] = tuple(int(s) for s in v.size)
                self.dtypes[k] = v.properties.dtype

    def read(self, key: str, lead: Sequence[int] = ()) -> torch.Tensor:
        """Tensor ``key`` (fp32 copy of its saved dtype), or with ``lead`` its sub-tensor at those leading
        indices (``read(k, (3,))`` is ``full[3]``), reading only the chunks that overlap it."""
        import torch.distributed.checkpoint as dcp

        full = self.shapes[key]
        rest = full[len(lead) :]
        local = torch.empty((1,) * len(lead) + rest, dtype=self.dtypes[key])
        block = Block(local, full, tuple(lead) + (0,) * len(rest))
        with warnings.catch_warnings():  # DCP warns that it runs without a process group: intended
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({key: block}, checkpoint_id=self.path, planner=blocks.BlockLoadPlanner(), no_dist=True)
        return local.reshape(rest).float()
