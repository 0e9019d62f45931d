"""One overlap runtime: the state that hiding MoE communication needs, in one object.

An :class:`OverlapRuntime` holds the baton of the two lanes and their helper thread
(:class:`~folding.overlap.lanes.Lanes`), the deferred work per lane
(:class:`~folding.overlap.deferred.DeferredWork`), whether a schedule runs its steady state, the
observers of the exchanges (instruments: :class:`~folding.overlap.exchange.ExchangeObserver`) and the
baton's counters. Nothing of it is module-level: two runtimes in one process share nothing.

**Who creates it.** The schedule that runs the pairs (:func:`folding.pipeline.schedules.forward_backward`)
creates one for its call when its caller gives none; the trainer creates one for the whole run and
hands it to every step, so that the helper thread and the counters live as long as the run; a
benchmark or a test creates one to subscribe its instruments to.

**How code reaches it.** The schedule makes its runtime *current* for the step
(:meth:`OverlapRuntime.active`: a :class:`contextvars.ContextVar`; the module holds only the variable,
never a value). A layer's forward reads it there (:func:`current_runtime`, :func:`defer`; an exchange
binds to it when created), in the schedule's thread and in the helper lane (which runs in a copy of
the pair's context). A backward cannot read it there: on CUDA the autograd engine runs it on its own
device thread, whose context is empty. So every autograd function whose backward defers work or waits
on an exchange keeps the runtime of its forward (``ctx.overlap = current_runtime()``) and makes it
current again around its backward (``with entered(ctx.overlap):``), and activation recompute, which
runs a forward inside the backward, re-enters the runtime of the original forward
(:func:`recompute_contexts`, the ``context_fn`` of ``torch.utils.checkpoint``). Outside every runtime
(a layer run on its own) deferred work runs at once and an exchange's wait only waits.

Usage::

    runtime = OverlapRuntime()
    with runtime.active():                # the schedule, around one step
        runtime.run_pair(backward_of_m, forward_of_m_plus_1)
        runtime.flush_deferred()
    runtime.stats.pairs, runtime.stats.hand_overs
    runtime.close()                       # the helper thread ends
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Any, Callable, Iterator, List, Optional, Tuple

from .deferred import Deferred, DeferredWork
from .lanes import Lanes, Stats

_CURRENT: "contextvars.ContextVar[Optional[OverlapRuntime]]" = contextvars.ContextVar(
    "folding_overlap_runtime", default=None
)
"""The runtime current in a context (the variable only: its values live in the contexts)."""


class OverlapRuntime:
    """The lanes, deferred work, steady-state mark, observers and counters of one schedule's overlap
    (see the module docstring)."""

    def __init__(self) -> None:
        self.lanes = Lanes()
        """The baton, the helper thread and the counters."""
        self.deferred = DeferredWork(self.lanes)
        """The deferred work per lane."""
        self.observers: List[Any] = []
        """Instruments told about every exchange bound to this runtime, in the order installed
        (:class:`~folding.overlap.exchange.ExchangeObserver`; the exchange module imports this one)."""
        self.steady = False
        """Whether a schedule runs its steady state now (:meth:`steady_state`)."""

    @property
    def stats(self) -> Stats:
        """The pairs run and the hand-overs between their lanes (:class:`~folding.overlap.lanes.Stats`)."""
        return self.lanes.stats

    # -------------------------------------------------------------------------------- the schedule

    def active(self) -> contextlib.AbstractContextManager:
        """A context manager that makes this the current runtime inside its block (in the context of
        the thread that enters it)."""
        return entered(self)

    def run_pair(self, first: Callable[[], Any], second: Callable[[], Any]) -> Tuple[Any, Any]:
        """Run ``first`` and ``second`` as the two lanes of a pair
        (:meth:`~folding.overlap.lanes.Lanes.run_pair`)."""
        return self.lanes.run_pair(first, second)

    def in_pair(self) -> bool:
        """Whether a pair runs with its other lane alive (:meth:`~folding.overlap.lanes.Lanes.in_pair`)."""
        return self.lanes.in_pair()

    def running_lane(self) -> Optional[int]:
        """The lane holding the baton (0 or 1), or None outside a pair."""
        return self.lanes.running_lane()

    def lane_thread(self) -> threading.Thread:
        """The persistent thread that runs every pair's second lane."""
        return self.lanes.lane_thread()

    def defer(self, fn: Callable[[], Any]) -> Deferred:
        """Queue ``fn`` for the running lane's next exchange wait
        (:meth:`~folding.overlap.deferred.DeferredWork.defer`)."""
        return self.deferred.defer(fn)

    def flush_deferred(self) -> None:
        """Run the running lane's deferred work now (outside a pair: all of it)."""
        self.deferred.flush()

    @contextlib.contextmanager
    def steady_state(self) -> Iterator[None]:
        """Mark the block as the steady state of a schedule (where it runs its pairs), for the audit: an
        exchange started inside it is expected to have compute of the other lane between its start and
        its wait."""
        old, self.steady = self.steady, True
        try:
            yield
        finally:
            self.steady = old

    def close(self) -> None:
        """End the helper thread (a later pair starts another)."""
        self.lanes.close()

    def __enter__(self) -> "OverlapRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------ instruments

    @contextlib.contextmanager
    def observe(self, observer: Any) -> Iterator[Any]:
        """Tell ``observer`` (an :class:`~folding.overlap.exchange.ExchangeObserver`) about every exchange
        of this runtime inside the block; yields it."""
        self.observers.append(observer)
        try:
            yield observer
        finally:
            self.observers.remove(observer)

    def set_helper_context(self, factory: Optional[Callable[[], Any]]) -> None:
        """Make the second lane of every later pair enter ``factory()`` (a context manager) around its
        work; ``None``: nothing. For instruments; the engine sets none."""
        self.lanes.helper_context = factory


class _Entered:
    """Makes a runtime current around a block; re-entrant (a recompute may run more than once)."""

    def __init__(self, runtime: Optional[OverlapRuntime]) -> None:
        self.runtime = runtime
        self._tokens: List[contextvars.Token] = []

    def __enter__(self) -> Optional[OverlapRuntime]:
        self._tokens.append(_CURRENT.set(self.runtime))
        return self.runtime

    def __exit__(self, *exc) -> None:
        _CURRENT.reset(self._tokens.pop())


def entered(runtime: Optional[OverlapRuntime]) -> contextlib.AbstractContextManager:
    """A context manager that makes ``runtime`` (``None``: none) current inside its block and yields it:
    a backward re-enters the runtime its forward kept (module docstring)."""
    return _Entered(runtime)


def current_runtime() -> Optional[OverlapRuntime]:
    """The runtime current in this context (:meth:`OverlapRuntime.active`), or None."""
    return _CURRENT.get()


def defer(fn: Callable[[], Any]) -> Deferred:
    """Queue ``fn`` on the current runtime (:meth:`OverlapRuntime.defer`); outside every runtime run it
    now (nothing would run it later) and return its handle."""
    rt = _CURRENT.get()
    if rt is not None:
        return rt.defer(fn)
    d = Deferred(fn, [])
    d.run()
    return d


def flush_deferred() -> None:
    """Run the running lane's deferred work of the current runtime now (:meth:`OverlapRuntime.flush_deferred`);
    nothing outside every runtime (work deferred there ran at once)."""
    rt = _CURRENT.get()
    if rt is not None:
        rt.flush_deferred()


def in_pair() -> bool:
    """Whether the current runtime runs a pair with its other lane alive (False outside every runtime)."""
    rt = _CURRENT.get()
    return rt is not None and rt.in_pair()


def recompute_contexts() -> Tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """The ``context_fn`` of ``torch.utils.checkpoint`` (non-reentrant) for a region that defers work or
    waits on exchanges: nothing around the forward, and the runtime current at the forward made current
    again around the recompute (which runs inside the backward, on CUDA on the engine's thread)."""
    return contextlib.nullcontext(), entered(_CURRENT.get())
