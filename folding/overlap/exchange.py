"""The exchange record: collectives issued together for one token exchange, waited on once.

Every token exchange of the engine (the dispatchers' EP all-to-alls, ETP all-gathers and
reduce-scatters, the count all-gathers) is waited on through an :class:`Exchange`: created right after
its ``async_op=True`` collectives were issued, :meth:`Exchange.wait` before their outputs are read.
The record says what the exchange is and carries:

- ``works``: the collectives' work handles;
- ``what``: its name (``"ep dispatch"``, ``"etp all-gather"``, ``"ep counts"``...);
- ``carries``: the kind of its payload: :data:`TOKENS` (token rows between EP ranks, flat or through
  the node and rail groups), :data:`ETP_ROWS` (rows between the ETP ranks of one expert shard),
  :data:`COUNTS` (metadata the host reads);
- ``group`` and ``messages``: the process group it runs on and, per all-to-all, the rows sent to and
  received from each rank with the bytes of a row (:class:`Message`);
- ``overlap_point``: whether its wait runs deferred work and hands the baton to the other lane of a
  pair (``False`` for a wait that only reads a result, the token counts).

It binds to the overlap runtime current when it is created
(:func:`folding.overlap.runtime.current_runtime`). In its wait it runs the lane's deferred work and
hands the baton over (:class:`Exchange`); the runtime's observers (:class:`ExchangeObserver`) are told
of its issue and its wait: that is how instruments (a link model, the order audit, wait statistics in
:mod:`folding.testing`) watch the exchanges, so the engine passes none of their parameters and imports
none of them.

Usage::

    ex = Exchange(works, what="ep dispatch", group=ep_group, messages=[Message(ep_group, send, recv, 4096)])
    ex.wait()
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from .runtime import current_runtime

if TYPE_CHECKING:
    from .runtime import OverlapRuntime

TOKENS = "tokens"
"""``Exchange.carries`` of an EP token exchange (rows and their probabilities between EP ranks)."""
ETP_ROWS = "etp rows"
"""``Exchange.carries`` of an exchange between the ETP ranks of one expert shard."""
COUNTS = "counts"
"""``Exchange.carries`` of a metadata exchange whose result the host reads (the token counts)."""


class Message:
    """One uneven all-to-all of an exchange: its process group (``None``: the world), the rows sent to
    and received from each of its ranks, and the bytes of one row."""

    __slots__ = ("group", "send_rows", "recv_rows", "row_bytes")

    def __init__(self, group: Any, send_rows: Sequence[int], recv_rows: Sequence[int], row_bytes: int) -> None:
        self.group = group
        self.send_rows = send_rows
        self.recv_rows = recv_rows
        self.row_bytes = row_bytes

    @property
    def send_bytes(self) -> List[int]:
        """Bytes sent to each rank of the group."""
        return [n * self.row_bytes for n in self.send_rows]

    @property
    def recv_bytes(self) -> List[int]:
        """Bytes received from each rank of the group."""
        return [n * self.row_bytes for n in self.recv_rows]


class ExchangeObserver:
    """What an instrument subscribed with :meth:`folding.overlap.runtime.OverlapRuntime.observe` is told
    about every exchange of that runtime (no-ops here)."""

    def issued(self, ex: "Exchange") -> None:
        """``ex`` was created, right after its collectives were issued."""

    def settle(self, ex: "Exchange") -> None:
        """``ex``'s collectives completed; an instrument may block here (a link model sleeps until the
        modelled completion)."""

    def finished(self, ex: "Exchange", waited_s: float) -> None:
        """``ex``'s wait is over; ``waited_s``: the seconds it blocked (every settle included)."""


class Exchange:
    """Collectives issued together (``async_op=True``) for one token exchange, waited on once.

    Create it right after issuing them (module docstring for the fields); :meth:`wait` runs this lane's
    deferred work and hands the baton to the other lane of the runtime's running pair, then waits for
    the collectives. In a pair the deferred work is split around the other lane's piece: the first half
    of it (rounded up: the shared expert, or the experts' fc2 weight gradient) before the hand-over, the
    rest when the baton is back. The work that can go anywhere thus covers both exchanges in flight at
    the hand-over, this lane's and the other lane's, instead of padding one and leaving the other to
    wait. ``runtime``: the runtime it belongs to (default: the current one; ``None`` outside every
    runtime: the wait only waits).
    """

    __slots__ = (
        "works",
        "what",
        "carries",
        "group",
        "messages",
        "overlap_point",
        "runtime",
        "start",
        "steady",
        "paired",
        "done",
        "marks",
    )

    def __init__(
        self,
        works: Sequence[Any],
        *,
        what: str,
        carries: str = TOKENS,
        group: Any = None,
        messages: Sequence[Message] = (),
        overlap_point: bool = True,
        runtime: Optional["OverlapRuntime"] = None,
    ):
        self.works = list(works)
        self.what = what
        self.carries = carries
        self.group = group
        self.messages = messages
        self.overlap_point = overlap_point
        self.runtime = runtime if runtime is not None else current_runtime()
        self.start = time.perf_counter()
        self.steady = self.runtime is not None and self.runtime.steady
        """Whether it was issued in a schedule's steady state."""
        self.paired = False
        """Whether a pair was running with its other lane alive when this was waited on."""
        self.done = False
        self.marks: Dict[str, Any] = {}
        """Notes of the instruments watching (:class:`ExchangeObserver`), by their own keys."""
        if self.runtime is not None:
            for o in self.runtime.observers:
                o.issued(self)

    def wait(self) -> None:
        """Complete the exchange (see the class docstring); a second call does nothing."""
        if self.done:
            return
        self.done = True
        rt = self.runtime
        if rt is not None and self.overlap_point:
            self.paired = rt.lanes.in_pair()
            if self.paired:  # half of this lane's deferred work before the other lane's piece, half after
                q = rt.deferred.queue()
                for d in q[: (len(q) + 1) // 2]:
                    d.run()
            rt.lanes.hand_over()
            rt.deferred.flush()
        t0 = time.perf_counter()
        for w in self.works:
            w.wait()
        observers = rt.observers if rt is not None else ()
        for o in observers:
            o.settle(self)
        waited = time.perf_counter() - t0
        for o in observers:
            o.finished(self, waited)
