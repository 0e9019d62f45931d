"""Deferred work: what a lane queues to run while its next exchange is in flight, and its flush.

:class:`DeferredWork` (one per :class:`~folding.overlap.runtime.OverlapRuntime`) keeps the work not yet
run, one queue per lane of the running pair (``None``: outside a pair):

- :meth:`DeferredWork.defer` queues work for the running lane; :class:`Deferred` is its handle
  (:meth:`Deferred.result` runs it at the latest);
- :meth:`DeferredWork.flush` runs the running lane's deferred work now (outside a pair: all of it);
- :meth:`DeferredWork.queue` is the running lane's queue, which an exchange's wait runs
  (:class:`folding.overlap.exchange.Exchange`: half before the other lane's piece, half after).

Work deferred during a backward runs by the end of that backward at the latest: the first deferral of
a backward queues an end-of-backward callback on the autograd engine that flushes what no exchange ran.

Usage::

    work = DeferredWork(lanes)
    shared = work.defer(lambda: shared_expert(tokens_TH))     # runs inside the next exchange wait
    y = shared.result()
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Set

import torch

from .lanes import Lanes


class Deferred:
    """Work that runs while the next exchange is in flight (or when its result is first needed)."""

    def __init__(self, fn: Callable[[], Any], queue: List["Deferred"]):
        self._fn: Optional[Callable[[], Any]] = fn
        self._value: Any = None
        self._grad = torch.is_grad_enabled()
        self._queue = queue

    def run(self) -> None:
        """Run the work now if it has not run yet, in the grad mode it was deferred in (an exchange
        may wait inside an autograd function's forward, where grad mode is off)."""
        if self._fn is not None:
            fn, self._fn = self._fn, None
            if self in self._queue:
                self._queue.remove(self)
            with torch.set_grad_enabled(self._grad):
                self._value = fn()

    def result(self) -> Any:
        """The work's result (running it first if no exchange has run it yet)."""
        self.run()
        return self._value


class DeferredWork:
    """The deferred work of one runtime, per lane of its running pair (see the module docstring)."""

    def __init__(self, lanes: Lanes) -> None:
        self.lanes = lanes
        """Whose running lane owns new work."""
        self._queues: Dict[Optional[int], List[Deferred]] = {}
        self._flush_queued: Set[int] = set()  # the backwards (graph task ids) whose flush is queued

    def queue(self) -> List[Deferred]:
        """The deferred work of the lane that runs now (each lane runs only its own: a lane's work may
        start autograd graph tasks, which only the first lane may)."""
        return self._queues.setdefault(self.lanes.running_lane(), [])

    def pending(self) -> int:
        """How many deferred pieces of work have not run yet (every lane)."""
        return sum(len(q) for q in self._queues.values())

    def flush(self) -> None:
        """Run the deferred work of the running lane now (outside a pair: all of it), e.g. a backward's
        weight gradients that no exchange ran."""
        queues = [self.queue()] if self.lanes.running_lane() is not None else list(self._queues.values())
        for q in queues:
            while q:
                q[0].run()

    def defer(self, fn: Callable[[], Any]) -> Deferred:
        """Queue ``fn`` to run inside the next exchange wait of the running lane, while that exchange is
        in flight (in a pair: before or after the other lane's piece); :meth:`Deferred.result` runs it
        at the latest, and a deferral inside a backward is flushed by that backward's end (module
        docstring). Used for the shared expert during its own micro-batch's dispatch and for weight
        gradients (``parallel.delay_wgrad``)."""
        q = self.queue()
        d = Deferred(fn, q)
        q.append(d)
        if torch._C._current_graph_task_id() != -1:
            self._flush_at_backward_end()
        return d

    def _flush_at_backward_end(self) -> None:
        """Queue :meth:`flush` at the end of the running backward (once per backward)."""
        task = torch._C._current_graph_task_id()
        if task in self._flush_queued:
            return
        self._flush_queued.add(task)

        def flush() -> None:
            self._flush_queued.discard(task)
            self.flush()

        from torch.autograd.variable import Variable

        Variable._execution_engine.queue_callback(flush)
