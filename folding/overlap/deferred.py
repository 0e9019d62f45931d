"""Deferred work: what a lane queues to run while its next exchange is in flight, and its flush.

- :func:`defer` queues work for the running lane; :class:`Deferred` is its handle
  (:meth:`Deferred.result` runs it at the latest).
- :func:`flush_deferred` runs the running lane's deferred work now (outside a pair: all of it).

The exchange record (:class:`folding.overlap.exchange.Exchange`) runs the work inside its wait.

Usage::

    shared = defer(lambda: shared_expert(tokens_TH))     # runs inside the next exchange wait
    y = shared.result()
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from .lanes import running_lane

_deferred: Dict[Optional[int], List["Deferred"]] = {}
"""Deferred work not yet run, per lane of the running pair that deferred it (``None``: outside a pair)."""

# ------------------------------------------------------------------------------- deferred work


class Deferred:
    """Work that runs while the next exchange is in flight (or when its result is first needed)."""

    def __init__(self, fn: Callable[[], Any]):
        self._fn: Optional[Callable[[], Any]] = fn
        self._value: Any = None
        self._grad = torch.is_grad_enabled()
        self._queue: List["Deferred"] = _lane_queue()

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


def _lane_queue() -> List[Deferred]:
    """The deferred work of the lane that runs now (each lane runs only its own: a lane's work may
    start autograd graph tasks, which only the first lane may)."""
    return _deferred.setdefault(running_lane(), [])


def flush_deferred() -> None:
    """Run the deferred work of the running lane now (outside a pair: all of it), e.g. a backward's
    weight gradients that no exchange ran."""
    queues = [_lane_queue()] if running_lane() is not None else list(_deferred.values())
    for q in queues:
        while q:
            q[0].run()


def defer(fn: Callable[[], Any]) -> Deferred:
    """Queue ``fn`` to run inside the next :class:`Exchange` wait of the running lane, while that
    exchange is in flight (in a pair: before or after the other lane's piece, :class:`Exchange`);
    :meth:`Deferred.result` runs it at the latest. Used for the shared expert during its own
    micro-batch's dispatch and for the experts' weight gradients (``parallel.delay_wgrad``).

    Work deferred during a backward runs by the end of that backward at the latest: the first
    deferral of a backward queues an end-of-backward callback on the autograd engine that runs what no
    exchange ran (:func:`flush_deferred`). A layer used outside the engine's schedules (embedded in
    another training loop, or a backward with no exchange after its experts) thus has every gradient
    when ``backward`` returns, as without deferral."""
    d = Deferred(fn)
    d._queue.append(d)
    if torch._C._current_graph_task_id() != -1:
        _flush_at_backward_end()
    return d


_flush_queued: set = set()
"""The backwards (autograd graph task ids) whose end-of-backward flush is queued."""


def _flush_at_backward_end() -> None:
    """Queue :func:`flush_deferred` at the end of the running backward (once per backward)."""
    task = torch._C._current_graph_task_id()
    if task in _flush_queued:
        return
    _flush_queued.add(task)

    def flush() -> None:
        _flush_queued.discard(task)
        flush_deferred()

    from torch.autograd.variable import Variable

    Variable._execution_engine.queue_callback(flush)
