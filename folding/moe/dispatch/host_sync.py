"""The one instrumented device-to-host read of the MoE code path.

Every place in ``folding.moe`` that needs a device value on the host (split sizes for an uneven
all-to-all, the number of rows kept after token dropping) calls :func:`to_host`. On a GPU such a read
blocks the host until the device catches up, so the dispatcher performs at most one per layer in
dropless mode (deferred to just before the expert all-to-all needs its split sizes) and none with
pad-to-capacity. The counter lets tests and benchmarks check that promise.

The dispatchers' count read is :func:`read_counts`, shaped so that the wait costs as little as it can:
the lane's deferred work (the shared expert, which needs no counts) is issued before it, and the copy is
non-blocking into pinned memory with an event (:func:`start_read`; on a CPU a plain copy, the same
code path).

Usage::

    from folding.moe.dispatch import host_sync
    before = host_sync.count()
    splits = host_sync.to_host(counts_RE, reason="alltoall splits")   # nested Python lists
    assert host_sync.count() - before == 1
    splits = host_sync.read_counts(counts_dev, work=counts_exchange, reason="alltoall splits")
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...overlap.runtime import flush_deferred

_COUNT = 0


def to_host(t: torch.Tensor, *, reason: str) -> Any:
    """Copy ``t`` to the host and return it as Python numbers (``tensor.tolist()``).

    ``reason`` names the caller where the read happens (kept at every call site so that a profile or
    a failing count test points at it). This is a device-to-host synchronization on accelerators:
    call it once per layer at most.
    """
    global _COUNT
    _COUNT += 1
    return t.detach().to("cpu").tolist()


class HostRead:
    """A device-to-host copy in flight (:func:`start_read`); :meth:`result` waits for it and returns the
    values as Python numbers."""

    def __init__(self, host: torch.Tensor, event: Optional[Any]):
        self._host, self._event = host, event

    def result(self) -> Any:
        """Wait for the copy (on a GPU, its event: the host blocks until the device has copied) and return
        ``tolist()`` of the host tensor."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host.tolist()


def start_read(t: torch.Tensor, *, reason: str) -> HostRead:
    """Start copying ``t`` to the host and return the :class:`HostRead` that completes it; counted like
    :func:`to_host` (``reason`` names the caller).

    On a GPU the copy goes into pinned host memory with ``non_blocking=True`` (``Tensor.to("cpu",
    non_blocking=True)`` pins its output for a CUDA source) and an event is recorded behind it on the
    current stream, so the host may do other work until :meth:`HostRead.result`. A pageable copy would
    block the host at once. On a CPU the same call is a plain (synchronous) copy and there is no event.
    """
    global _COUNT
    _COUNT += 1
    host = t.detach().to("cpu", non_blocking=True)
    event = None
    if t.is_cuda:
        event = torch.cuda.Event()
        event.record()
    return HostRead(host, event)


def read_counts(counts: torch.Tensor, *, work: Optional[Any] = None, reason: str) -> Any:
    """The dispatchers' read of their gathered token counts on the host (``counts.tolist()``), the one
    device-to-host read of a dropless layer, in this order:

    1. the running lane's deferred work runs (:func:`folding.overlap.runtime.flush_deferred`: the
       shared expert, which needs no counts), so it is issued before anything waits for the counts
       (on a GPU its kernels run while the counts travel and the host waits);
    2. ``work`` (the count gather's :class:`~folding.overlap.exchange.Exchange`, or ``None``) is waited
       on: on NCCL the stream waits, not the host;
    3. the copy to the host starts (:func:`start_read`: pinned, non-blocking, with an event) and the
       host waits for it and reads it.

    The wait in step 2 is an overlap point of a pair: the baton goes to the other lane while the counts
    travel (the other lane's compute hides them) and comes back before the copy. The forward lane thus
    hands over three times per MoE layer (the count read, the dispatch, the combine) against the
    backward lane's two exchange waits; the MoE layer gives the backward its third turn where the layer's
    input gradient is ready (:func:`folding.overlap.backward_turn.turn_in_backward`), so that neither
    lane's last exchanges of a pair find the other lane finished (the order audit of
    ``tests/distributed/test_overlap.py`` checks every steady exchange)."""
    flush_deferred()
    if work is not None:
        work.wait()
    return start_read(counts, reason=reason).result()


def count() -> int:
    """Total number of host reads (:func:`to_host`, :func:`start_read`) in this process since start-up (or
    the last reset)."""
    return _COUNT


def reset() -> None:
    """Set the counter back to zero."""
    global _COUNT
    _COUNT = 0
