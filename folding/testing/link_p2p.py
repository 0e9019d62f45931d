"""The link model's view of point-to-point transfers (pipeline sends and receives; tests and benchmarks only).

On NCCL a receive completes no earlier than the sender's stream reached the send (plus the bytes' time
on the link); the receiver's stream waits for it, its host does not. NCCL runs point-to-point on
communicators of their own per pair of ranks, so a transfer is not queued behind the group's collectives
and is not in the links' sharing here. While :func:`folding.testing.link_spy.spying` is active,
``torch.distributed.batch_isend_irecv`` (the engine's one point-to-point call) publishes, for every send,
the sender's stream time under the pair's running index (every pair sends in one order, NCCL's), and the
last work of the batch, once waited on, makes the receiver's stream wait for each received tensor.

Usage: installed by :func:`folding.testing.link_spy.spying`; nothing to call.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Tuple

import torch.distributed as dist

PEER_TIMEOUT_S = 5.0
"""How long a receive looks for its sender's published time (it is there once the data is)."""


class _Work:
    """One work of a batch: the first wait on the batch notes the stream's time; the last work's wait,
    after the real one, makes the stream wait for the batch's receives."""

    def __init__(self, work, batch: dict, last: bool):
        self._work, self._batch, self._last = work, batch, last

    def wait(self, *args, **kwargs):
        """Wait for the real transfer (see the class docstring)."""
        b = self._batch
        if b["since"] is None:
            b["since"] = b["links"].stream_time()
        out = self._work.wait(*args, **kwargs)
        if self._last and b["arrived"] is not None:
            arrived, b["arrived"] = b["arrived"], None
            arrived(b["since"])
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def spy_batch(real, links, publish, peer_times):
    """``batch_isend_irecv`` reporting its transfers to ``links`` (``publish`` / ``peer_times``: the
    store helpers of :mod:`folding.testing.link_spy`)."""
    sent: Dict[Tuple[int, int], int] = {}
    received: Dict[Tuple[int, int], int] = {}

    def key(src: int, dst: int, seq: int) -> str:
        return f"folding/link2/{links.session}/p2p/{src}-{dst}/{seq}"

    def batch_isend_irecv(p2p_op_list):
        me = dist.get_rank()
        own = links.stream_time()
        recvs: List[Tuple[str, Any]] = []
        for op in p2p_op_list:
            nbytes = op.tensor.numel() * op.tensor.element_size()
            if "send" in op.op.__name__:
                n = sent.get((me, op.peer), 0)
                sent[(me, op.peer)] = n + 1
                publish(key(me, op.peer, n), own)
            else:
                n = received.get((op.peer, me), 0)
                received[(op.peer, me)] = n + 1
                recvs.append((key(op.peer, me, n), _seconds(links, me, op.peer, nbytes)))
        works = list(real(p2p_op_list))
        if not recvs or not works:
            return works

        def arrived(since):
            done = []
            for k, cost in recvs:
                t = peer_times([k], PEER_TIMEOUT_S)
                done.append((t[0] if t else time.perf_counter()) + cost)
            links.received(max(done), since)

        batch = dict(links=links, since=None, arrived=arrived)
        return [_Work(w, batch, i == len(works) - 1) for i, w in enumerate(works)]

    batch_isend_irecv.__wrapped__ = real
    return batch_isend_irecv


def _seconds(links, me: int, peer: int, nbytes: int) -> float:
    """A transfer's time on its link class (no sharing) plus the message latency."""
    m = links.model
    bw = m.intra_node_bandwidth if m.node(peer) == m.node(me) else m.inter_node_bandwidth
    return links.message_latency_s + (nbytes / bw if bw else 0.0)
