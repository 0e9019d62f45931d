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
- :func:`link_latency` (benchmarks and tests only): a link model under which every token exchange
  completes no earlier than a set time after it was issued, by sleeping (no CPU used), as a slow
  network would; :func:`folding.parallel.link_model.link_model` extends it to two link classes
  (inter-node and intra-node, each with its bandwidth), the exchange's bytes on each counted.
- :func:`audit` records, for each exchange, the compute operations issued between its start and its
  wait (the order audit of the overlap tests).
- :data:`stats` accumulates the time spent blocked in exchange waits (the benchmark's exposed time) and
  counts the pairs run and the hand-overs between their lanes (the trainer reports both per step).

The baton is held by lanes, not threads: a lane may be served by another thread (the autograd engine
runs CUDA backward on its own device thread), so the state is module-level and guarded by one
condition variable. A pair is confined to the process that runs it.

Usage::

    losses = run_pair(lambda: forward(chunk, m + 1), lambda: backward(chunk, m))
    ex = Exchange(works, what="dispatch")      # inside the wire layer, after issuing
    ex.wait()
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from . import link_model as _links
from .link_model import LinkBytes, link_latency  # noqa: F401  (link_latency: this module's name for it)

# ------------------------------------------------------------------------------------ the baton


class _Pair:
    """The state of one running pair: whose turn it is and which lanes have finished."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.turn = 0
        self.done = [False, False]
        self.error: Optional[BaseException] = None


_pair: Optional[_Pair] = None
_deferred: List["Deferred"] = []


def in_pair() -> bool:
    """True while a pair runs and its other lane has not finished (a hand-over would switch lanes)."""
    p = _pair
    return p is not None and not p.done[1 - p.turn]


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
        p.turn = 1 - me
        p.cond.notify_all()
        p.cond.wait_for(lambda: p.turn == me)


def run_pair(first: Callable[[], Any], second: Callable[[], Any]) -> Tuple[Any, Any]:
    """Run ``first`` and ``second`` as the two lanes of a pair; return both results.

    ``first`` starts; each lane hands over at every :class:`Exchange` it waits on while the other is
    still running. ``second`` runs on a helper thread that inherits this thread's grad mode and, on
    CUDA, its current device and stream. An exception in either lane is raised here once both lanes
    have ended (a lane that raises ends; the other runs on to its end alone).
    """
    global _pair
    if _pair is not None:  # already inside a pair: run one after the other
        return first(), second()
    p = _Pair()
    results: List[Any] = [None, None]
    grad = torch.is_grad_enabled()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    device = torch.cuda.current_device() if cuda else None
    stream = torch.cuda.current_stream() if cuda else None
    mode = _audit_mode

    def lane(i: int, fn: Callable[[], Any], helper: bool) -> None:
        with p.cond:
            p.cond.wait_for(lambda: p.turn == i)
        try:
            with contextlib.ExitStack() as stack:
                if helper:
                    stack.enter_context(torch.set_grad_enabled(grad))
                    if cuda:
                        torch.cuda.set_device(device)
                        stack.enter_context(torch.cuda.stream(stream))
                    if mode is not None:
                        stack.enter_context(mode())
                results[i] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by run_pair
            if p.error is None:
                p.error = e
        finally:
            with p.cond:
                p.done[i] = True
                p.turn = 1 - i
                p.cond.notify_all()

    _pair = p
    stats.pairs += 1
    try:
        helper = threading.Thread(target=lane, args=(1, second, True), name="folding-lane", daemon=True)
        helper.start()
        lane(0, first, False)
        with p.cond:
            p.cond.wait_for(lambda: p.done[1])
        helper.join()
    finally:
        _pair = None
    if p.error is not None:
        raise p.error
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


# ------------------------------------------------------------------------------ link model & stats


@dataclasses.dataclass
class Stats:
    """Time blocked in exchange waits since the last :meth:`reset` (seconds)."""

    blocked_s: float = 0.0
    """Wall time spent waiting for exchanges to complete (what the exchanges cost the critical path)."""
    pairs: int = 0
    """Pairs run as two lanes (:func:`run_pair` outside another pair): proof that overlap was on."""
    hand_overs: int = 0
    """Hand-overs that switched lanes at an exchange (each one hides an exchange behind the other lane)."""
    blocked_by: Dict[str, float] = dataclasses.field(default_factory=dict)
    """``blocked_s`` split by what was waited on (an exchange's ``what``, ``"ep counts"`` for the
    dispatchers' host reads of their count all-gathers)."""

    def add_blocked(self, what: str, seconds: float) -> None:
        """Count ``seconds`` blocked waiting on ``what``."""
        self.blocked_s += seconds
        self.blocked_by[what] = self.blocked_by.get(what, 0.0) + seconds

    def reset(self) -> None:
        """Zero the counters."""
        self.blocked_s = 0.0
        self.pairs = 0
        self.hand_overs = 0
        self.blocked_by = {}


stats = Stats()
"""Process-wide exchange-wait counters (read by benchmarks)."""

# ------------------------------------------------------------------------------------- the audit

_audit_log: Optional[List[Dict[str, Any]]] = None
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
_op_count = [0]


def _counting_mode():
    """A dispatch mode that counts the compute operations (every aten op but views and metadata)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func._schema.is_mutable and "view" not in func.__name__:
                _op_count[0] += 1
            return func(*args, **(kwargs or {}))

    return _Count()


@contextlib.contextmanager
def audit() -> Iterator[List[Dict[str, Any]]]:
    """Record every exchange inside the block: a list of ``{"what", "steady", "paired", "ops"}``,
    where ``ops`` counts the compute operations this process issued between the exchange's start and
    its wait (in either lane), ``steady`` says whether it started inside :func:`steady_state` and
    ``paired`` whether a pair was running with its other lane alive when it was waited on."""
    global _audit_log, _audit_mode
    log: List[Dict[str, Any]] = []
    _audit_log, _audit_mode = log, _counting_mode
    try:
        with _counting_mode():
            yield log
    finally:
        _audit_log, _audit_mode = None, None


# ---------------------------------------------------------------------------------- the exchange


class Exchange:
    """Collectives issued together (``async_op=True``) for one token exchange, waited on once.

    Create it right after issuing them; :meth:`wait` runs the deferred work, hands the baton to the
    other lane of a running pair, then waits for the collectives (and, under a link model, until the
    modelled duration has passed since the start: :mod:`folding.parallel.link_model`). ``what`` names the
    exchange in the audit; ``linked``: an EP exchange (the only kind the link model delays); ``link_bytes``:
    its bytes per link class (``None``: the latency alone applies); ``group``: the process group its
    collectives run on, whose issue order the link model keeps (NCCL's rule:
    :func:`folding.parallel.link_model.issue`).
    """

    __slots__ = ("works", "what", "start", "ops", "linked", "done", "steady", "link_bytes", "done_at")

    def __init__(
        self,
        works: Sequence[Any],
        *,
        what: str,
        linked: bool = True,
        link_bytes: Optional[LinkBytes] = None,
        group: Any = None,
    ):
        self.works = list(works)
        self.what = what
        self.linked = linked
        self.link_bytes = link_bytes
        self.start = time.perf_counter()
        self.ops = _op_count[0]
        self.steady = _steady[0]
        self.done = False
        model = _links.current()
        duration = 0.0
        if linked and model.active:
            duration = model.latency_s if link_bytes is None else link_bytes.duration(model)
            if link_bytes is not None:
                _links.traffic.record(link_bytes)
        self.done_at = _links.issue(group, duration)

    def wait(self) -> None:
        """Complete the exchange (see the class docstring); a second call does nothing."""
        if self.done:
            return
        self.done = True
        flush_deferred()
        paired = in_pair()
        _hand_over()
        t0 = time.perf_counter()
        for w in self.works:
            w.wait()
        _links.complete(self.done_at)
        stats.add_blocked(self.what, time.perf_counter() - t0)
        if _audit_log is not None:
            _audit_log.append(
                {"what": self.what, "steady": self.steady, "paired": paired, "ops": _op_count[0] - self.ops}
            )
