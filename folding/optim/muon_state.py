"""Muon's state and step for one gradient buffer of Muon parameters (``optim.name=muon``).

A :class:`MuonState` belongs to one :class:`~folding.optim.grad_buffer.GradBuffer` whose class has
``muon=True``. It holds the fp32 momentum of the matrices this rank *owns*: all of them without
ZeRO-1, and under ZeRO-1 (``optim.distributed=true``) those :func:`~folding.optim.muon_owner.assign_owners`
gives it in the buffer's data-parallel group (DP×CP dense, EDP expert), so that each matrix is
orthogonalized once per group and the momentum memory is split over it. The weights themselves
(fp32 master shards, or the parameters) are the optimizer's, as for AdamW.

One step of one bucket (:meth:`MuonState.step_bucket`), after reduction and clipping:

1. ZeRO-1 only: all-gather the reduced gradient shards over the DP group, so every rank holds the
   whole reduced gradient of the bucket (in place in ``main_grad``);
2. for each owned matrix, in stacks of at most ``NS_STACK_ELEMENTS`` full-matrix elements
   (:func:`~folding.optim.muon.stack_chunks`): momentum, Nesterov, the TP all-gather of the matrix
   (TP / ETP group), Newton–Schulz on the full matrix, this rank's piece back, times the update
   scale (:mod:`folding.optim.muon`), written into a bucket-sized update buffer that is zero elsewhere;
3. ZeRO-1 only: reduce-scatter (sum) of the update buffer over the DP group: each element has one
   owner and zeros from every other rank, so each rank receives exactly the updates of its shard;
4. the caller applies ``w ← w − lr·wd·w − lr·update`` to the range it updates.

Usage::

    ms = MuonState(buf, config)
    upd = ms.step_bucket(bucket)          # [hi - lo] fp32 update of this rank's range
    momenta = ms.bucket_momentum(bucket)  # [bucket numel] fp32, for checkpoints (collective)
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from ..parallel.collectives import reduce_scatter_single
from .config import OptimConfig
from .grad_buffer import Bucket, GradBuffer
from .muon import momentum_direction, newton_schulz5, stack_chunks, update_scale
from .muon_owner import MatrixLayout, assign_owners, gather_full, local_piece
from .reducer import all_gather_flat


class MuonState:
    """Momentum of the owned matrices of one Muon buffer, and its per-bucket step (module docstring)."""

    def __init__(self, buf: GradBuffer, config: OptimConfig):
        """``buf``: a buffer of Muon parameters; ``config``: its ``optim.muon_*`` settings."""
        self.buf, self.config = buf, config
        self.layouts: List[MatrixLayout] = [MatrixLayout.of(p, n) for n, p in zip(buf.names, buf.params)]
        sharded = buf.shard and buf.groups.dp_size > 1
        sizes = [lay.rows * lay.cols for lay in self.layouts for _ in range(lay.count)]
        owners = assign_owners(sizes, buf.groups.dp_size) if sharded else [buf.groups.dp_rank] * len(sizes)
        self.owned: List[List[int]] = []
        """Per parameter: the indices of the matrices this rank owns (keeps momentum for, orthogonalizes)."""
        pos = 0
        for lay in self.layouts:
            mine = [j for j in range(lay.count) if owners[pos + j] == buf.groups.dp_rank]
            self.owned.append(mine)
            pos += lay.count
        dev = buf.main_grad.device
        self.momentum: Dict[int, torch.Tensor] = {
            k: torch.zeros((len(mine),) + lay.local_shape[1:], dtype=torch.float32, device=dev)
            for k, (lay, mine) in enumerate(zip(self.layouts, self.owned))
            if mine
        }
        """Parameter index -> fp32 momentum ``[owned, M_local, N_local]``."""

    def _params_of(self, b: Bucket):
        for k, p in enumerate(self.buf.params):
            if self.buf.bucket_of[id(p)] is b:
                yield k, self.buf.offsets[k] - b.start, p.numel()

    @torch.no_grad()
    def step_bucket(self, b: Bucket) -> torch.Tensor:
        """The fp32 update (before ``-lr``) of this rank's range ``update_range(b)`` of bucket ``b``;
        steps 1–3 of the module docstring. Collective (DP, TP) under ZeRO-1 or tensor parallelism."""
        buf, c = self.buf, self.config
        sharded = buf.shard and buf.groups.dp_size > 1
        grads = buf.main_grad[b.start : b.end]
        if sharded:
            # all-gather (forward only) of the reduced, clipped gradient shards over the DP group
            # (DP×CP dense, EDP expert): each rank's shard is its own slot, so in place
            lo, hi = buf.shard_range(b)
            all_gather_flat(grads, buf.main_grad[lo:hi], buf.groups.dp_group).wait()
        update = torch.zeros(b.numel(), dtype=torch.float32, device=grads.device)
        for k, a, n in self._params_of(b):
            mine = self.owned[k]
            if not mine:
                continue
            lay = self.layouts[k]
            scale = update_scale(lay.rows, lay.cols, c.muon_update_scale)
            # the owned matrices in bounded stacks (NS_STACK_ELEMENTS): the Newton–Schulz working set
            # does not grow with the number of experts a rank owns
            for lo, hi in stack_chunks(len(mine), lay.rows * lay.cols):
                idx = torch.tensor(mine[lo:hi], device=grads.device)
                g = grads[a : a + n].view(lay.local_shape).index_select(0, idx)
                m = self.momentum[k][lo:hi]  # a view: updated in place
                u = momentum_direction(g, m, momentum=c.muon_momentum, nesterov=c.muon_nesterov)
                full = gather_full(u, lay, buf.groups.tp_group)  # TP / ETP all-gather when sharded
                del u
                o = local_piece(newton_schulz5(full, c.muon_ns_steps), lay)
                del full
                update[a : a + n].view(lay.local_shape).index_copy_(0, idx, o.mul_(scale))
        if not sharded:
            return update
        out = torch.empty(b.numel() // buf.groups.dp_size, dtype=torch.float32, device=update.device)
        # reduce-scatter (sum, forward only) over the DP group: every element has exactly one owner
        # and zeros elsewhere, so each rank receives its shard's updates exactly
        reduce_scatter_single(out, update, group=buf.groups.dp_group)
        return out

    @torch.no_grad()
    def bucket_momentum(self, b: Bucket) -> torch.Tensor:
        """The momentum of every matrix of bucket ``b`` as one flat fp32 tensor (zeros in padding).
        Under ZeRO-1 an all-reduce (sum, forward only) over the DP group assembles it: each matrix
        has one owner and zeros elsewhere, so the sum is exact. Collective on every DP rank."""
        out = torch.zeros(b.numel(), dtype=torch.float32, device=self.buf.main_grad.device)
        for k, a, n in self._params_of(b):
            if self.owned[k]:
                idx = torch.tensor(self.owned[k], device=out.device)
                out[a : a + n].view(self.layouts[k].local_shape).index_copy_(0, idx, self.momentum[k])
        if self.buf.shard and self.buf.groups.dp_size > 1:
            dist.all_reduce(out, group=self.buf.groups.dp_group)
        return out

    @torch.no_grad()
    def load_momentum(self, k: int, saved: torch.Tensor) -> None:
        """Keep the owned matrices of parameter ``k``'s saved momentum (parameter-shaped; no communication)."""
        if self.owned[k]:
            lay = self.layouts[k]
            idx = torch.tensor(self.owned[k], device=saved.device)
            src = saved.reshape(lay.local_shape).index_select(0, idx)
            self.momentum[k].copy_(src.to(self.momentum[k].device, torch.float32))

    def nbytes(self) -> int:
        """Bytes of the momentum this rank holds."""
        return sum(t.numel() * t.element_size() for t in self.momentum.values())
