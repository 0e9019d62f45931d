"""The true peak of live CPU tensor bytes over a region of code, from the PyTorch profiler's allocation events.

A CPU build of PyTorch keeps no peak-allocated statistic, but the profiler with
``profile_memory=True`` records every allocation and every free of the c10 CPU allocator (tensor
storages of any kind: activations, gradients, communication buffers, temporaries). This module
replays those events in time order: the running sum of allocated minus freed bytes is the change of
live tensor bytes since the region began, and its maximum is the region's peak *over* what was live
before. Add the bytes live before the region (:func:`storage_bytes` of the persistent tensors) to get
the true peak.

``prof.events()`` drops the allocation events on torch 2.x CPU builds; the profiler's event tree
(``prof.profiler.kineto_results.experimental_event_tree()``) keeps them, as nodes whose
``extra_fields`` are ``_ExtraFields_Allocation`` (``alloc_size`` negative for a free,
``ptr`` pairing a free with its allocation).

One limit of the CPU allocator: a block allocated *before* profiling started has no recorded size,
so its free inside the region is not reported. The running sum therefore counts exactly what the
region allocates and frees itself. Measure the persistent bytes before the region and check that the
region's net change (:attr:`PeakProfile.end_bytes`) is what it should be (about 0 for a training step
whose gradients live in persistent buffers): a large positive value means the region replaced
persistent tensors, whose old copies' frees went unseen.

Usage::

    with PeakProbe(with_stack=False) as probe:
        loss = model(ids).sum(); loss.backward(); opt.step()
    base = storage_bytes(persistent_tensors)          # measured before the region
    peak = base + probe.result.peak_bytes
    probe.result.live_at_peak[:5]                     # the largest allocations alive at the peak

With ``with_stack=True`` each allocation also carries the Python frames that made it (slower; for
finding out *which* tensors make the peak).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, List, Optional, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["Allocation", "PeakProfile", "PeakProbe", "allocation_events", "peak_of", "storage_bytes"]

_ALLOC = "_ExtraFields_Allocation"


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One allocation (or free, ``size < 0``) event of the CPU allocator."""

    time_ns: int
    """When it happened (profiler clock)."""
    size: int
    """Bytes allocated (positive) or freed (negative)."""
    ptr: int
    """Address of the block: pairs a free with the allocation it releases (an address is live at most
    once at a time)."""
    stack: Tuple[str, ...]
    """Names of the enclosing profiler events, outermost first (ops; Python frames with ``with_stack``)."""


@dataclasses.dataclass(frozen=True)
class PeakProfile:
    """What the allocation events of one profiled region say."""

    peak_bytes: int
    """Largest increase of live tensor bytes over the bytes live when the region began (>= 0; frees
    of blocks allocated before the region are not seen, see the module docstring)."""
    end_bytes: int
    """Net change of live tensor bytes at the end of the region (negative when it freed more)."""
    peak_time_ns: int
    """When the peak was reached (profiler clock, ``time.time_ns()``'s epoch; 0 when never above the start)."""
    num_events: int
    """Allocation plus free events replayed."""
    live_at_peak: List[Allocation]
    """Allocations made inside the region and still alive at the peak, largest first."""


def event_nodes(prof):
    """Depth-first ``(node, ancestor names)`` over a finished profile's event tree (the tree keeps what
    ``prof.events()`` drops: allocation events, and every op's input sizes and strides)."""
    stack = [(node, ()) for node in reversed(prof.profiler.kineto_results.experimental_event_tree())]
    while stack:
        node, names = stack.pop()
        yield node, names
        stack.extend((child, names + (node.name,)) for child in reversed(node.children))


def allocation_events(prof) -> List[Allocation]:
    """Every allocation/free event of a finished ``torch.profiler.profile(profile_memory=True)``, in time
    order (ties keep the order of the event tree's depth-first walk)."""
    out = [
        Allocation(
            time_ns=node.start_time_ns,
            size=int(node.extra_fields.alloc_size),
            ptr=int(node.extra_fields.ptr),
            stack=names,
        )
        for node, names in event_nodes(prof)
        if type(node.extra_fields).__name__ == _ALLOC
    ]
    return sorted(out, key=lambda a: a.time_ns)  # stable: ties keep walk order


def peak_of(events: Iterable[Allocation]) -> PeakProfile:
    """Replay ``events`` (time-ordered): the peak and final value of the running sum of bytes, and the
    allocations alive at the (first) peak."""
    # Only frees of blocks allocated inside the region count. The profiler sizes a free from a table
    # that outlives a profiled region: a block allocated under an earlier profiler and freed outside
    # any leaves a stale entry, and a later block at the same address, allocated before this region
    # and freed inside it, is then reported with the stale size (seen: -192 KiB in a region that
    # freed a 100 KiB tensor from before it).
    events, inside = list(events), set()
    replayed = []
    for ev in events:
        if ev.size > 0:
            inside.add(ev.ptr)
        elif ev.ptr in inside:
            inside.discard(ev.ptr)
        else:
            continue
        replayed.append(ev)
    events = replayed
    running = peak = 0
    peak_index = -1
    for i, ev in enumerate(events):
        running += ev.size
        if running > peak:
            peak, peak_index = running, i
    live = {}
    for ev in events[: peak_index + 1]:  # second pass: who is alive at the peak
        if ev.size > 0:
            live[ev.ptr] = ev
        else:
            live.pop(ev.ptr, None)
    at_peak = sorted(live.values(), key=lambda a: -a.size)
    n = len(events)
    return PeakProfile(
        peak_bytes=peak,
        end_bytes=running,
        num_events=n,
        peak_time_ns=events[peak_index].time_ns if peak_index >= 0 else 0,
        live_at_peak=at_peak,
    )


class PeakProbe:
    """Context manager: profile the enclosed code and leave its :class:`PeakProfile` in ``result``.

    ``with_stack``: record Python frames too, so that :attr:`Allocation.stack` names the files and
    functions that allocate (slower; use it to explain a peak, not to measure many layouts).
    """

    def __init__(self, *, with_stack: bool = False):
        self.with_stack = with_stack
        self.result: Optional[PeakProfile] = None
        self._prof = None

    def __enter__(self) -> "PeakProbe":
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=self.with_stack)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self.result = peak_of(allocation_events(self._prof))
        self._prof = None


def storage_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once; ``None`` skipped)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())
