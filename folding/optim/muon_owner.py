"""Where Muon's matrices live: the logical matrices of a parameter, their TP gather, their owner.

Newton–Schulz is not elementwise: it must see a weight's *full* logical matrix, whatever the layout,
for every layout to train like one rank. Three pure pieces and one collective:

- :class:`MatrixLayout` reads a parameter's record (:mod:`folding.parallel.params`): its full shape
  ends in the matrix ``[M, N]``; every leading dimension indexes separate matrices (experts, the gate
  and up halves of a fused fc1). A shard of one of the two matrix dimensions is a tensor-parallel
  shard (TP dense, ETP expert); shards of leading dimensions (EP) only choose which matrices a rank
  holds. The local parameter is viewed as ``[K, M_local, N_local]``.
- :func:`assign_owners` gives each matrix of a ZeRO-1 buffer one owner in the data-parallel group,
  deterministic and balanced by size (greedy, largest first): only the owner keeps its momentum and
  runs Newton–Schulz. Every rank of a TP group holds the same parameter list, so TP peers own the same
  matrices and their gathers pair up.
- :func:`gather_full` assembles the full matrices from the TP pieces (the collective), and
  :func:`local_piece` takes this rank's piece of a full result back. The matrix is *gathered*, not
  orthogonalized by a distributed Newton–Schulz: exact (the same fp32 matrix products as one rank)
  and simple, for the price of one TP all-gather of the stacked pieces per parameter.

Usage::

    lay = MatrixLayout.of(param, name)              # lay.count, lay.local_shape, lay.full_shape
    owners = assign_owners([lay.rows * lay.cols] * lay.count, ranks=4)
    full = gather_full(u_KMN, lay, tp_group)         # [K, M, N]
    piece = local_piece(newton_schulz5(full), lay)   # [K, M_local, N_local]
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Sequence, Tuple

import torch

from ..parallel.collectives import all_gather_nograd, group_size
from ..parallel.params import require_spec


@dataclasses.dataclass(frozen=True)
class MatrixLayout:
    """How one parameter splits into Muon matrices (see the module docstring)."""

    count: int
    """Matrices in the local parameter (product of its leading dimensions)."""
    rows: int
    """Full rows ``M`` of each logical matrix."""
    cols: int
    """Full columns ``N`` of each logical matrix."""
    shard_dim: Optional[int]
    """0 (rows) or 1 (columns): the matrix dimension split over the TP group; ``None`` if whole."""
    tp_index: int
    """This rank's chunk along ``shard_dim`` (0 when whole)."""
    tp_count: int
    """Chunks along ``shard_dim`` (1 when whole)."""

    @property
    def local_shape(self) -> Tuple[int, int, int]:
        """``[K, M_local, N_local]``: the view of the local parameter."""
        m, n = self.rows, self.cols
        if self.shard_dim == 0:
            m //= self.tp_count
        elif self.shard_dim == 1:
            n //= self.tp_count
        return (self.count, m, n)

    @staticmethod
    def of(param: torch.Tensor, name: str) -> "MatrixLayout":
        """The layout of ``param`` (named ``name``) from its record; raises ``ValueError`` when the
        record cuts a matrix dimension more than once."""
        spec = require_spec(param, name)
        full = spec.full_shape
        nd = len(full)
        held = list(full)
        tp = [(d - (nd - 2), i, c) for d, i, c in spec.shards if d >= nd - 2 and c > 1]
        for d, _, c in spec.shards:
            held[d] //= c
        if len(tp) > 1:
            raise ValueError(f"Muon: parameter {name!r} is split along both matrix dimensions {spec.shards}")
        if math.prod(held) != param.numel():
            raise ValueError(f"Muon: parameter {name!r} of {param.numel()} elements is not the slice {held}")
        dim, idx, cnt = tp[0] if tp else (None, 0, 1)
        return MatrixLayout(
            count=math.prod(held[:-2]), rows=full[-2], cols=full[-1], shard_dim=dim, tp_index=idx, tp_count=cnt
        )


def assign_owners(sizes: Sequence[int], ranks: int) -> List[int]:
    """Owner rank (in ``range(ranks)``) of each matrix of ``sizes`` (elements): largest first, each
    to the least-loaded rank so far (ties: the lowest rank; equal sizes keep their order). Pure and
    deterministic, so every rank computes the same table.

    Example: ``sizes=[8, 4, 4, 2]``, ``ranks=2`` -> ``[0, 1, 1, 0]`` (loads 10 and 8)."""
    load = [0] * ranks
    owners = [0] * len(sizes)
    for j in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owners[j] = r
        load[r] += sizes[j]
    return owners


def gather_full(piece_KMN: torch.Tensor, layout: MatrixLayout, tp_group) -> torch.Tensor:
    """The full matrices ``[K, M, N]`` from this rank's pieces ``[K, M_local, N_local]``.

    Collective over ``tp_group`` (the group that shards the matrix: TP dense, ETP expert) when the
    matrix is sharded: one all-gather of the stacked pieces in rank order, concatenated along the
    sharded dimension. Forward only (optimizer step, no autograd). Whole matrices return as they are."""
    if layout.shard_dim is None:
        return piece_KMN
    if group_size(tp_group) != layout.tp_count:
        raise ValueError(
            f"Muon: a matrix split in {layout.tp_count} along dim {layout.shard_dim} but the group has "
            f"{group_size(tp_group)} ranks"
        )
    pieces = all_gather_nograd(piece_KMN.contiguous(), tp_group, stack=True)  # [TP, K, m, n]
    return torch.cat(list(pieces.unbind(0)), dim=1 + layout.shard_dim)


def local_piece(full_KMN: torch.Tensor, layout: MatrixLayout) -> torch.Tensor:
    """This rank's piece ``[K, M_local, N_local]`` of full matrices ``[K, M, N]`` (no communication)."""
    if layout.shard_dim is None:
        return full_KMN
    return full_KMN.chunk(layout.tp_count, dim=1 + layout.shard_dim)[layout.tp_index]
