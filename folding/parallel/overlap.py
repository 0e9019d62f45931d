"""Hiding MoE communication behind compute: two lanes that take turns at every token exchange.

A *pair* runs two pieces of work, for example the forward of micro-batch ``i + 1`` and the backward
of micro-batch ``i`` in the steady state of a pipeline schedule, as two *lanes* that hold one baton:
exactly one lane runs at any time, and a lane hands the baton over only at an exchange, right after it
has issued its collectives and before it waits for them. While one lane's exchange is in flight the
other lane computes, so the exchange is hidden behind that compute instead of sitting on the critical
path. Because one lane runs at a time and the hand-over points are fixed by the program (not by
timing), every rank issues its collectives in the same order, and each lane runs exactly the
operations it would run alone: results are bitwise those of running the two pieces one after the
other.

- :func:`run_pair` runs two callables as a pair (the first lane starts); nested or single use is fine.
- :class:`Exchange` is the one way the engine waits on a token exchange: ``Exchange(works, what=...)``
  right after issuing ``async_op=True`` collectives, ``.wait()`` before reading their outputs. Between
  the two it runs the work deferred with :func:`defer` (the shared expert during its own dispatch),
  then hands the baton to the other lane of the pair, if any.
- :data:`stats` counts the pairs run and the hand-overs between their lanes (the trainer reports both
  per step).
- :func:`observe` is the neutral hook of test and benchmark instruments, which live in
  :mod:`folding.testing` and which the engine never imports: the link model
  (:mod:`folding.testing.link_model`, every EP exchange completes no earlier than a modelled time),
  the order audit and the wait statistics (:mod:`folding.testing.overlap_audit`). While one watches,
  the wire counts each exchange's bytes into an :class:`ExchangeBytes` (:func:`exchange_bytes`);
  :func:`steady_state` marks where a schedule runs its pairs, for the audit.

The baton is held by lanes, not threads: a lane may be served by another thread (the autograd engine
runs CUDA backward on its own device thread), so the state is module-level and guarded by one
condition variable. A pair is confined to the process that runs it.

**Lanes and the autograd engine.** On CUDA the first lane's backward runs on the engine's one device
thread, which a hand-over parks; a graph task started by the second lane would queue behind it and
both would wait for ever. So the second lane never starts one: :func:`run_pair` puts a guard in front
of the engine (every ``backward`` and ``autograd.grad`` passes it) that raises :class:`LaneError` when
the helper lane tries, and the pair raises it even if the lane's code swallowed it. The second lane
always runs on the same persistent thread (:func:`lane_thread`, created on the first pair), so
per-thread state (CUDA-graph trees, thread-local caches) is built once, not per pair.

**Randomness across a hand-over.** The default generators (CPU, and the current CUDA device's) are
process-global, and non-reentrant activation recompute forks them (sets the forward's saved state,
restores its own on exit) around work that may hand over. Each lane therefore draws from its own copy:
a hand-over saves the leaving lane's generator state and restores the arriving lane's, both starting
from the state at the pair's start. At the end the pair keeps the state of the lane that advanced it;
when both did, their draws have no order that running them one after the other would give, and the
pair raises :class:`LaneError`. (The schedule pairs a backward, which draws nothing net: recompute
restores what it forked.)

Usage::

    losses = run_pair(lambda: forward(chunk, m + 1), lambda: backward(chunk, m))
    ex = Exchange(works, what="dispatch")      # inside the wire layer, after issuing
    ex.wait()
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

# ------------------------------------------------------------------------------------ the baton


class LaneError(RuntimeError):
    """A pair broke a rule of its lanes: the second lane started an autograd graph task (it would
    deadlock behind the first lane's parked backward on CUDA), or both lanes drew random numbers."""


_RngState = Tuple[torch.Tensor, Optional[torch.Tensor]]


class _Pair:
    """The state of one running pair: whose turn it is, which lanes have finished, and each lane's
    generator state while the other lane runs."""

    def __init__(self, rng: _RngState, cuda_index: Optional[int]) -> None:
        self.cond = threading.Condition()
        self.turn = 0
        self.done = [False, False]
        self.error: Optional[BaseException] = None
        self.cuda_index = cuda_index
        self.rng_start = rng
        self.rng: List[_RngState] = [rng, rng]


_pair: Optional[_Pair] = None
_deferred: List["Deferred"] = []
_lane = threading.local()  # .helper: True while this thread runs the second lane of a pair


def in_pair() -> bool:
    """True while a pair runs and its other lane has not finished (a hand-over would switch lanes)."""
    p = _pair
    return p is not None and not p.done[1 - p.turn]


def running_lane() -> Optional[int]:
    """The lane of the running pair that holds the baton (0: the first, 1: the second), or None when no
    pair runs."""
    p = _pair
    return None if p is None else p.turn


# ------------------------------------------------------------------- generators, one copy per lane


def _rng_get(cuda_index: Optional[int]) -> _RngState:
    cuda = None if cuda_index is None else torch.cuda.get_rng_state(cuda_index)
    return torch.get_rng_state(), cuda


def _rng_set(state: _RngState, cuda_index: Optional[int]) -> None:
    torch.set_rng_state(state[0])
    if cuda_index is not None:
        torch.cuda.set_rng_state(state[1], cuda_index)


def _rng_same(a: _RngState, b: _RngState) -> bool:
    # bytes, not torch.equal: no operator reaches a dispatch mode (the audit counts operators)
    return all(x is None or x.numpy().tobytes() == y.numpy().tobytes() for x, y in zip(a, b))


def _leave(p: _Pair, me: int) -> None:
    """Lane ``me`` gives the baton away (under ``p.cond``): keep its generator state for its return."""
    p.rng[me] = _rng_get(p.cuda_index)


def _arrive(p: _Pair, me: int) -> None:
    """Lane ``me`` holds the baton again: its own generator state back."""
    _rng_set(p.rng[me], p.cuda_index)


def _hand_over() -> None:
    """Give the baton to the other lane of the running pair and wait until it comes back (no-op
    outside a pair, or once the other lane has finished)."""
    p = _pair
    if p is None:
        return
    with p.cond:
        me = p.turn
        if p.done[1 - me]:
            return
        stats.hand_overs += 1
        _leave(p, me)
        p.turn = 1 - me
        p.cond.notify_all()
        p.cond.wait_for(lambda: p.turn == me)
        _arrive(p, me)


# ----------------------------------------------------------------- the helper lane and the engine


class _EngineGuard:
    """Stands in front of the autograd engine (``Variable._execution_engine``, which every
    ``backward`` and ``autograd.grad`` calls): refuses a graph task started by the second lane of a
    pair; everything else passes through unchanged."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        """The engine's ``run_backward``, unless called from the helper lane (:class:`LaneError`)."""
        if getattr(_lane, "helper", False):
            err = LaneError(
                "the second lane of an overlap pair started an autograd graph task (backward or "
                "autograd.grad): on CUDA it would wait for ever behind the first lane's backward, parked on "
                "the engine's device thread. Run it before the pair (a first-use probe: when the model is "
                "built) or in the first lane, or set parallel.overlap_moe_comm=false"
            )
            p = _pair
            if p is not None and p.error is None:
                p.error = err  # raised by run_pair even if the lane's code catches it
            raise err
        return self.engine.run_backward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def _guard_autograd_engine() -> None:
    """Put :class:`_EngineGuard` in front of the autograd engine (once per process)."""
    from torch.autograd.variable import Variable

    if not isinstance(Variable._execution_engine, _EngineGuard):
        Variable._execution_engine = _EngineGuard(Variable._execution_engine)


class _LaneThread:
    """The one thread that runs the second lane of every pair: it takes lane jobs from a queue."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.jobs: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="folding-lane", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            self.jobs.get()()


_helper: Optional[_LaneThread] = None
_helper_lock = threading.Lock()


def _lane_server() -> _LaneThread:
    global _helper
    with _helper_lock:
        if _helper is None or _helper.pid != os.getpid() or not _helper.thread.is_alive():
            _helper = _LaneThread()
        return _helper


def lane_thread() -> threading.Thread:
    """The persistent thread that runs the second lane of every pair in this process (started on the
    first call; a forked child starts its own)."""
    return _lane_server().thread


def run_pair(first: Callable[[], Any], second: Callable[[], Any]) -> Tuple[Any, Any]:
    """Run ``first`` and ``second`` as the two lanes of a pair; return both results.

    ``first`` starts; each lane hands over at every :class:`Exchange` it waits on while the other is
    still running. ``second`` runs on the persistent :func:`lane_thread`, in this thread's grad mode
    and, on CUDA, its current device and stream; it must not start an autograd graph task
    (:class:`LaneError`). Each lane draws random numbers from its own copy of the generators (module
    docstring). An exception in either lane is raised here once both lanes have ended (a lane that
    raises ends; the other runs on to its end alone).
    """
    global _pair
    if _pair is not None:  # already inside a pair: run one after the other
        return first(), second()
    _guard_autograd_engine()
    grad = torch.is_grad_enabled()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    device = torch.cuda.current_device() if cuda else None
    stream = torch.cuda.current_stream() if cuda else None
    p = _Pair(_rng_get(device), device)
    results: List[Any] = [None, None]
    mode = _audit_mode

    def lane(i: int, fn: Callable[[], Any], helper: bool) -> None:
        with p.cond:
            p.cond.wait_for(lambda: p.turn == i)
            _arrive(p, i)
        try:
            with contextlib.ExitStack() as stack:
                if helper:
                    stack.enter_context(torch.set_grad_enabled(grad))
                    if cuda:
                        torch.cuda.set_device(device)
                        stack.enter_context(torch.cuda.stream(stream))
                    if mode is not None:
                        stack.enter_context(mode())
                    _lane.helper = True
                    stack.callback(setattr, _lane, "helper", False)
                results[i] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by run_pair
            if p.error is None:
                p.error = e
        finally:
            with p.cond:
                _leave(p, i)
                p.done[i] = True
                p.turn = 1 - i
                p.cond.notify_all()

    _pair = p
    stats.pairs += 1
    try:
        _lane_server().jobs.put(lambda: lane(1, second, True))
        lane(0, first, False)
        with p.cond:
            p.cond.wait_for(lambda: p.done[1])
    finally:
        _pair = None
    moved = [not _rng_same(p.rng[i], p.rng_start) for i in (0, 1)]
    _rng_set(p.rng[1] if moved[1] else p.rng[0], device)
    if p.error is not None:
        raise p.error
    if all(moved):
        raise LaneError(
            "both lanes of an overlap pair drew random numbers from the default generators: no order of "
            "running them one after the other gives those draws. Draw them in one lane only (the schedule "
            "pairs a backward, which must draw none outside a recompute), or set parallel.overlap_moe_comm=false"
        )
    return results[0], results[1]


# ------------------------------------------------------------------------------- deferred work


class Deferred:
    """Work that runs while the next exchange is in flight (or when its result is first needed)."""

    def __init__(self, fn: Callable[[], Any]):
        self._fn: Optional[Callable[[], Any]] = fn
        self._value: Any = None
        self._grad = torch.is_grad_enabled()

    def run(self) -> None:
        """Run the work now if it has not run yet, in the grad mode it was deferred in (an exchange
        may wait inside an autograd function's forward, where grad mode is off)."""
        if self._fn is not None:
            fn, self._fn = self._fn, None
            if self in _deferred:
                _deferred.remove(self)
            with torch.set_grad_enabled(self._grad):
                self._value = fn()

    def result(self) -> Any:
        """The work's result (running it first if no exchange has run it yet)."""
        self.run()
        return self._value


def flush_deferred() -> None:
    """Run every deferred piece of work now (a backward's weight gradients that no exchange ran)."""
    while _deferred:
        _deferred[0].run()


def defer(fn: Callable[[], Any]) -> Deferred:
    """Queue ``fn`` to run inside the next :class:`Exchange` wait of the running lane, after the
    exchange's collectives are issued and before any hand-over; :meth:`Deferred.result` runs it
    at the latest. Used for the shared expert during its own micro-batch's dispatch."""
    d = Deferred(fn)
    _deferred.append(d)
    return d


# --------------------------------------------------------------------------------- the baton's counts


@dataclasses.dataclass
class Stats:
    """The pairs run and the hand-overs between their lanes since the last :meth:`reset`."""

    pairs: int = 0
    """Pairs run as two lanes (:func:`run_pair` outside another pair): proof that overlap was on."""
    hand_overs: int = 0
    """Hand-overs that switched lanes at an exchange (each one hides an exchange behind the other lane)."""

    def reset(self) -> None:
        """Zero the counters."""
        self.pairs = 0
        self.hand_overs = 0


stats = Stats()
"""Process-wide counters of the baton (the trainer reports them per step)."""

# ------------------------------------------------------------------------------------ instruments

_steady = [False]


@contextlib.contextmanager
def steady_state() -> Iterator[None]:
    """Mark the block as the steady state of a schedule (where a pipeline schedule runs its pairs), for
    the audit: an exchange started inside it is expected to have compute of the other lane between its
    start and its wait."""
    old, _steady[0] = _steady[0], True
    try:
        yield
    finally:
        _steady[0] = old


_audit_mode: Optional[Callable[[], Any]] = None
"""A context factory the helper lane of a pair enters (an instrument's: the order audit's operation
counter, :mod:`folding.testing.overlap_audit`); ``None`` in the engine."""


class ExchangeObserver:
    """What an instrument installed with :func:`observe` is told about every exchange (no-ops here).

    Test and benchmark instruments (:mod:`folding.testing.link_model`,
    :mod:`folding.testing.overlap_audit`) watch the exchanges this way; the engine knows none of them."""

    def issued(self, ex: "Exchange") -> None:
        """``ex`` was created, right after its collectives were issued."""

    def settle(self, ex: "Exchange") -> None:
        """``ex``'s collectives completed; an instrument may block here (a link model sleeps until the
        modelled completion)."""

    def finished(self, ex: "Exchange", waited_s: float) -> None:
        """``ex``'s wait is over; ``waited_s``: the seconds it blocked (every settle included)."""


_observers: List[ExchangeObserver] = []


@contextlib.contextmanager
def observe(observer: ExchangeObserver) -> Iterator[ExchangeObserver]:
    """Tell ``observer`` about every exchange inside the block (observers are told in the order they
    were installed); yields it."""
    _observers.append(observer)
    try:
        yield observer
    finally:
        _observers.remove(observer)


class ExchangeBytes:
    """The messages of one exchange, for an instrument that prices them (a link model): per message its
    process group and the bytes sent to / received from each rank of it. Collected only while an
    instrument watches (:func:`exchange_bytes`)."""

    __slots__ = ("messages",)

    def __init__(self) -> None:
        self.messages: List[Tuple[Any, List[int], List[int]]] = []

    def add(self, group, send_bytes: Sequence[int], recv_bytes: Sequence[int]) -> None:
        """One message over ``group`` (``None``: the world): ``send_bytes[i]`` / ``recv_bytes[i]`` to /
        from its rank ``i``."""
        self.messages.append((group, list(send_bytes), list(recv_bytes)))


def exchange_bytes() -> Optional[ExchangeBytes]:
    """An empty :class:`ExchangeBytes` to count one exchange's messages into while an instrument
    watches (:func:`observe`); ``None`` otherwise (nothing to count)."""
    return ExchangeBytes() if _observers else None


# ---------------------------------------------------------------------------------- the exchange


class Exchange:
    """Collectives issued together (``async_op=True``) for one token exchange, waited on once.

    Create it right after issuing them; :meth:`wait` runs the deferred work, hands the baton to the
    other lane of a running pair, then waits for the collectives. ``what`` names the exchange (in the
    order audit); ``linked``: an EP exchange (the only kind a link model delays); ``link_bytes``: its
    messages' bytes (:func:`exchange_bytes`; ``None``: not counted); ``group``: the process group its
    collectives run on (whose issue order a link model keeps, as NCCL does); ``overlap_point``:
    ``False`` for a wait that only reads a result (the token counts), which runs no deferred work and
    hands nothing over. Instruments installed with :func:`observe` are told of its issue and its wait
    (:class:`ExchangeObserver`).
    """

    __slots__ = (
        "works",
        "what",
        "start",
        "linked",
        "done",
        "steady",
        "link_bytes",
        "group",
        "overlap_point",
        "paired",
        "marks",
    )

    def __init__(
        self,
        works: Sequence[Any],
        *,
        what: str,
        linked: bool = True,
        link_bytes: Optional[ExchangeBytes] = None,
        group: Any = None,
        overlap_point: bool = True,
    ):
        self.works = list(works)
        self.what = what
        self.linked = linked
        self.link_bytes = link_bytes
        self.group = group
        self.overlap_point = overlap_point
        self.start = time.perf_counter()
        self.steady = _steady[0]
        self.paired = False
        """Whether a pair was running with its other lane alive when this was waited on."""
        self.done = False
        self.marks: Dict[str, Any] = {}
        """Notes of the instruments watching (:class:`ExchangeObserver`), by their own keys."""
        for o in _observers:
            o.issued(self)

    def wait(self) -> None:
        """Complete the exchange (see the class docstring); a second call does nothing."""
        if self.done:
            return
        self.done = True
        if self.overlap_point:
            flush_deferred()
            self.paired = in_pair()
            _hand_over()
        t0 = time.perf_counter()
        for w in self.works:
            w.wait()
        for o in _observers:
            o.settle(self)
        waited = time.perf_counter() - t0
        for o in _observers:
            o.finished(self, waited)
