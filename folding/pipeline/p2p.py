"""Point-to-point activation and gradient exchange between pipeline stages.

Every exchange is one ``torch.distributed.batch_isend_irecv`` group (one ``ncclGroupStart/End`` on
NCCL), waited for before the caller goes on; no other kind of point-to-point call is made, so
batched and unbatched operations never meet on one pair of ranks. Tags are not used: which message
is which follows from the order in which both ends issue them, which :mod:`.comm_plan` makes the same
on both ends. The previous rank is offset −1 and the next offset +1 in the pipeline ring.

Usage::

    p2p = P2P(pp_group=ps.groups.pp, pp_ranks=ps.coords.pp.ranks, pp_rank=ps.coords.pp.rank)
    got = p2p.exchange(sends=[(+1, activation)], recvs=[(-1, shape, dtype, device)])
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist


class P2P:
    """Grouped sends and receives on one pipeline group (see the module docstring)."""

    def __init__(self, *, pp_group, pp_ranks: Sequence[int], pp_rank: int):
        self.group = pp_group
        self.ranks = list(pp_ranks)
        self.pp = len(self.ranks)
        self.pp_rank = pp_rank

    def peer(self, offset: int) -> int:
        """The global rank ``offset`` steps along the pipeline ring from this one."""
        return self.ranks[(self.pp_rank + offset) % self.pp]

    def exchange(
        self,
        *,
        sends: Sequence[Tuple[int, torch.Tensor]],
        recvs: Sequence[Tuple[int, Sequence[int], torch.dtype, torch.device]],
    ) -> List[torch.Tensor]:
        """Send each ``(offset, tensor)`` and receive one ``(offset, shape, dtype, device)`` buffer
        each, all in one group, in the order given; return the received tensors once all complete.

        No autograd: the schedule routes gradients itself (a forward activation is sent here, its
        gradient comes back through a later exchange).
        """
        ops, bufs, keep = [], [], []
        for offset, t in sends:
            buf = t.detach().contiguous()
            keep.append(buf)
            ops.append(dist.P2POp(dist.isend, buf, self.peer(offset), group=self.group))
        for offset, shape, dtype, device in recvs:
            buf = torch.empty(tuple(shape), dtype=dtype, device=device)
            bufs.append(buf)
            ops.append(dist.P2POp(dist.irecv, buf, self.peer(offset), group=self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return bufs
