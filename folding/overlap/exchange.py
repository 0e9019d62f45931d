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
  The lanes and their rules (the autograd engine's device thread, one generator copy per lane, the one
  persistent helper thread) are :mod:`folding.overlap.lanes`; this module re-exports its public names.
- :class:`Exchange` is the one way the engine waits on a token exchange: ``Exchange(works, what=...)``
  right after issuing ``async_op=True`` collectives, ``.wait()`` before reading their outputs. Between
  the two it runs the work this lane deferred with :func:`defer` (the shared expert during its own
  dispatch, the experts' weight gradients during the backward's dispatch) and hands the baton to the
  other lane of the pair, if any: half of the work before the hand-over, the rest after it.
- :data:`stats` counts the pairs run and the hand-overs between their lanes (the trainer reports both
  per step).
- :func:`observe` is the neutral hook of test and benchmark instruments, which live in
  :mod:`folding.testing` and which the engine never imports: the link model
  (:mod:`folding.testing.link_model`, every EP exchange completes no earlier than a modelled time),
  the order audit and the wait statistics (:mod:`folding.testing.overlap_audit`). While one watches,
  the wire counts each exchange's bytes into an :class:`ExchangeBytes` (:func:`exchange_bytes`);
  :func:`steady_state` marks where a schedule runs its pairs, for the audit.

Usage::

    losses = run_pair(lambda: forward(chunk, m + 1), lambda: backward(chunk, m))
    ex = Exchange(works, what="dispatch")      # inside the wire layer, after issuing
    ex.wait()
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from .deferred import Deferred, _lane_queue, defer, flush_deferred
from .lanes import LaneError, Stats, hand_over, in_pair, lane_thread, run_pair, running_lane, stats

__all__ = [
    "Deferred",
    "Exchange",
    "ExchangeBytes",
    "ExchangeObserver",
    "LaneError",
    "Stats",
    "defer",
    "exchange_bytes",
    "flush_deferred",
    "in_pair",
    "lane_thread",
    "observe",
    "run_pair",
    "running_lane",
    "stats",
    "steady_state",
]

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

    Create it right after issuing them; :meth:`wait` runs this lane's deferred work and hands the baton
    to the other lane of a running pair, then waits for the collectives. In a pair the deferred work is
    split around the other lane's piece: the first half of it (rounded up: the shared expert, or the
    experts' fc2 weight gradient) before the hand-over, the rest when the baton is back. The work that
    can go anywhere thus covers both exchanges in flight at the hand-over, this lane's and the other
    lane's, instead of padding one and leaving the other to wait. ``what`` names the exchange (in the
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
            self.paired = in_pair()
            if self.paired:  # half of this lane's deferred work before the other lane's piece, half after
                q = _lane_queue()
                for d in q[: (len(q) + 1) // 2]:
                    d.run()
            hand_over()
            flush_deferred()
        t0 = time.perf_counter()
        for w in self.works:
            w.wait()
        for o in _observers:
            o.settle(self)
        waited = time.perf_counter() - t0
        for o in _observers:
            o.finished(self, waited)
