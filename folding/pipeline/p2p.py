"""Point-to-point activation and gradient exchange between pipeline stages.

Virtual stage ``v`` of a pipeline of ``pp`` ranks with ``vpp`` chunks per rank lives on pipeline
rank ``v % pp`` as chunk ``v // pp``; activations flow from ``v`` to ``v + 1`` (the next rank in the
ring) and gradients back. Every message has a tag derived from (direction, virtual stage,
micro-batch), so messages can never be matched out of order. Sends are asynchronous
(``isend``; the buffers are kept alive until :meth:`P2P.wait_sends`), receives block.

Usage::

    p2p = P2P(pp_group=ps.pp_group, pp_ranks=ps.ranks["pp"], pp_rank=ps.pp_rank, num_virtual=pp * vpp)
    p2p.send_forward(out, vstage=v, microbatch=m)          # to v + 1
    x = p2p.recv_forward(shape, dtype, vstage=v, microbatch=m, device=dev)   # from v - 1
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist


class P2P:
    """Tagged point-to-point messages on one pipeline group (see the module docstring)."""

    def __init__(self, *, pp_group, pp_ranks: Sequence[int], pp_rank: int, num_virtual: int):
        self.group = pp_group
        self.ranks = list(pp_ranks)
        self.pp = len(self.ranks)
        self.pp_rank = pp_rank
        self.num_virtual = num_virtual
        self._pending: List = []

    def _tag(self, direction: int, vstage: int, microbatch: int) -> int:
        return (microbatch * self.num_virtual + vstage) * 2 + direction

    def _peer(self, offset: int) -> int:
        return self.ranks[(self.pp_rank + offset) % self.pp]

    def send_forward(self, t: torch.Tensor, *, vstage: int, microbatch: int) -> None:
        """Send the output of virtual stage ``vstage`` to the rank holding ``vstage + 1`` (async)."""
        buf = t.detach().contiguous()
        self._pending.append((dist.isend(buf, self._peer(1), group=self.group,
                                         tag=self._tag(0, vstage + 1, microbatch)), buf))

    def recv_forward(self, shape, dtype, *, vstage: int, microbatch: int, device) -> torch.Tensor:
        """Receive the input of virtual stage ``vstage`` from the rank holding ``vstage - 1`` (blocking)."""
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.irecv(buf, self._peer(-1), group=self.group, tag=self._tag(0, vstage, microbatch)).wait()
        return buf

    def send_backward(self, t: torch.Tensor, *, vstage: int, microbatch: int) -> None:
        """Send the gradient of the input of ``vstage`` to the rank holding ``vstage - 1`` (async)."""
        buf = t.detach().contiguous()
        self._pending.append((dist.isend(buf, self._peer(-1), group=self.group,
                                         tag=self._tag(1, vstage - 1, microbatch)), buf))

    def recv_backward(self, shape, dtype, *, vstage: int, microbatch: int, device) -> torch.Tensor:
        """Receive the gradient of the output of ``vstage`` from the rank holding ``vstage + 1`` (blocking)."""
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.irecv(buf, self._peer(1), group=self.group, tag=self._tag(1, vstage, microbatch)).wait()
        return buf

    def wait_sends(self) -> None:
        """Wait for every outstanding send and release its buffer."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
