"""Tensors as blocks of their full (1-rank) tensor, in the form ``torch.distributed.checkpoint`` reads.

Every parameter of a rank is one rectangular block of the parameter's full tensor: its
:class:`~folding.parallel.params.ParamSpec` (``require_spec``) gives the full shape and the
``(dim, index, count)`` cuts, :func:`~folding.parallel.params.shard_index` the block's offsets. A
:class:`Block` hands DCP exactly that: the global size, one chunk ``(offsets, sizes)`` and the local
tensor viewed in the block's shape. DCP's default planners (through :class:`BlockSavePlanner` /
:class:`BlockLoadPlanner`, which only teach the lookup of a key's local tensor about blocks) then

- on save, write every distinct block once (DP replicas and TP-replicated parameters produce the
  same ``(name, offsets)`` write item, which the coordinator deduplicates), and record the global
  shape;
- on load, read for each block every saved chunk that overlaps it, whatever layout wrote them.

So TP, CP, PP, VPP, EP, ETP and the distributed optimizer may all differ between save and load.

``torch.distributed.checkpoint`` is imported when it is first needed (a block's write items, the first
planner), not with this module: the import (DTensor, DCP's planners) costs about 0.6 s of CPU, which a
process that never reads or writes a checkpoint does not pay (every rank of a job without
``checkpoint.dir`` or ``checkpoint.load``, a refused configuration, a dry run). The planners subclass
DCP's, so they are built on their first use: ``blocks.BlockSavePlanner`` and ``blocks.BlockLoadPlanner``
are module attributes resolved then (:func:`__getattr__`).

Legend: the block of expert ``fc1`` of full shape ``[E, 2, F, H]`` held as ``[E/EP, 2·F/ETP, H]``
is viewed as ``[E/EP, 2, F/ETP, H]`` at offsets ``(ep_rank·E/EP, 0, etp_rank·F/ETP, 0)``.

Usage::

    sd = {"model/" + name: Block.for_spec(p.detach(), spec) for name, p in ...}
    dcp.save(sd, checkpoint_id=path, planner=BlockSavePlanner())
    dcp.load(sd, checkpoint_id=path, planner=BlockLoadPlanner())     # fills every p in place
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Dict, List, Sequence

import torch

from ..parallel.params import ParamSpec, shard_index

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem


class Block:
    """One rank's rectangular block of a full tensor, for DCP's save and load planners.

    ``local`` is the rank's values viewed in the block's shape (a view of the live tensor: a load
    writes into it in place); ``offsets`` where the block starts in the full tensor of shape
    ``full_shape``. ``mirrors`` are other live tensors (same number of elements) that hold the same
    values on this rank and are refreshed from ``local`` by :meth:`sync_mirrors` after a load (the
    tied embedding table held by both the first and the last pipeline chunk).
    """

    def __init__(self, local: torch.Tensor, full_shape: Sequence[int], offsets: Sequence[int]):
        """Check that the block fits inside the full tensor."""
        if len(full_shape) != local.dim() or len(offsets) != local.dim():
            raise ValueError(f"block of shape {tuple(local.shape)} does not match full shape {tuple(full_shape)}")
        for o, n, f in zip(offsets, local.shape, full_shape):
            if o < 0 or o + n > f:
                raise ValueError(
                    f"block {tuple(local.shape)} at {tuple(offsets)} exceeds full shape {tuple(full_shape)}"
                )
        self.local = local
        self.full_shape = torch.Size(int(s) for s in full_shape)
        self.offsets = torch.Size(int(o) for o in offsets)
        self.mirrors: List[torch.Tensor] = []

    @classmethod
    def for_spec(cls, tensor: torch.Tensor, spec: ParamSpec) -> "Block":
        """The block that ``tensor`` (a rank's parameter, or state shaped like it) is of ``spec``'s full tensor."""
        idx = shard_index(spec.full_shape, spec.shards)
        shape = tuple(s.stop - s.start for s in idx)
        if math.prod(shape) != tensor.numel():
            raise ValueError(f"tensor of shape {tuple(tensor.shape)} is not the block {shape} of {spec.full_shape}")
        return cls(tensor.view(shape), spec.full_shape, tuple(s.start for s in idx))

    @classmethod
    def whole(cls, tensor: torch.Tensor) -> "Block":
        """A tensor every rank holds in full (replicated)."""
        return cls(tensor, tuple(tensor.shape), (0,) * tensor.dim())

    # ------------------------------------------------------------------ DCP's chunk protocol
    def size(self) -> torch.Size:
        """The full tensor's shape (DCP compares it with the saved one on load)."""
        return self.full_shape

    def __create_write_items__(self, fqn: str, obj) -> List[WriteItem]:
        """One shard write item: this block at its offsets."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, self.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.shape),
                    properties=TensorProperties.create_from_tensor(self.local),
                    size=self.full_shape,
                ),
            )
        ]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        """The single chunk this rank holds (what a load must fill)."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.shape)]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The local block (the only chunk there is)."""
        if index.offset is not None and torch.Size(index.offset) != self.offsets:
            raise ValueError(f"{index.fqn}: no block at offsets {tuple(index.offset)} on this rank")
        return self.local

    def sync_mirrors(self) -> None:
        """Copy the loaded values into every mirror."""
        for m in self.mirrors:
            m.copy_(self.local.reshape(m.shape))


@functools.lru_cache(maxsize=None)
def _planners() -> Dict[str, type]:
    """DCP's default planners taught about :class:`Block` (built once, on first use: they subclass DCP's)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    class BlockSavePlanner(DefaultSavePlanner):
        """DCP's default save planner, resolving :class:`Block` values to their local tensor."""

        def __init__(self):
            """A planner with flattening off (the state dict is already flat). Identical blocks of several
            ranks are written once (DCP deduplicates write items by key and offsets)."""
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def lookup_object(self, index: MetadataIndex):
            """The local block for ``index`` (a plain tensor or object for any other value)."""
            obj = self.state_dict.get(index.fqn)
            if isinstance(obj, Block):
                return obj.__get_tensor_shard__(index)
            return super().lookup_object(index)

    class BlockLoadPlanner(DefaultLoadPlanner):
        """DCP's default load planner for a flat ``{key: Block | tensor}`` state dict, resolving
        :class:`Block` values to their local tensor (no flattening, no re-initialization of values)."""

        def __init__(self):
            """A planner with flattening off (the state dict is already flat)."""
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
            """Keep the state dict as given (the default set-up would replace non-tensor values)."""
            self.original_state_dict = state_dict
            self.state_dict = state_dict
            self.metadata = metadata
            self.is_coordinator = is_coordinator

        def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
            """The local block for ``index`` (a plain tensor for any other value)."""
            obj = self.state_dict.get(index.fqn)
            if isinstance(obj, Block):
                return obj.__get_tensor_shard__(index)
            return super().lookup_tensor(index)

    return {"BlockSavePlanner": BlockSavePlanner, "BlockLoadPlanner": BlockLoadPlanner}


def __getattr__(name: str):
    """``BlockSavePlanner`` and ``BlockLoadPlanner``: DCP's default planners resolving :class:`Block` values to
    their local tensor (the save planner writes identical blocks of several ranks once; the load planner keeps
    the flat state dict as given), built when first asked for."""
    if name in ("BlockSavePlanner", "BlockLoadPlanner"):
        return _planners()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
