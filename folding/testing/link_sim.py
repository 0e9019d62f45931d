"""The event simulation behind the CPU link model: communicators, shared links and the stream (pure).

No ``torch.distributed`` here: times are plain seconds handed in by the caller
(:mod:`folding.testing.link_model` uses ``time.perf_counter``), so the rules are unit-tested with
hand-made times. Three rules, each NCCL's or CUDA's:

- **One communicator, one queue.** Operations issued on one communicator (a process group: its
  identity, not its rank list) run one after another in issue order, whoever issued them (token
  exchanges, TP gathers, router all-reduces, gradient reductions): an operation starts no earlier
  than its *ready* time (when every rank's stream has reached it) and than the completion of the one
  issued before it on its communicator. Without ``fifo`` every operation starts when it is ready.
- **A link's bandwidth is shared.** Each link class (``"inter"``: this rank's NIC, ``"intra"``: its
  NVLink port) carries the bytes of every transfer in flight on it at once, each getting an equal
  share (processor sharing): two transfers of ``b`` bytes that start together on a link of bandwidth
  ``B`` both end ``2b / B`` later. A transfer's bytes on two classes drain at the same time, each at
  that class's share; the operation ends its ``latency`` after the last of its bytes
  (:class:`Op`). A bandwidth of ``None`` is unlimited.
- **The stream waits; the host does not** (:class:`Stream`). ``Work.wait()`` on NCCL makes the
  current stream wait for the operation and returns at once; compute launched after it runs after
  the operation on the stream. The host blocks only where it needs a result (a device-to-host read,
  a synchronization, the end of a step): there it waits for the stream to catch up. On one CPU the
  host runs the compute itself, so the stream's time is the host's plus a *lag*: a wait at host time
  ``t`` on an operation that completes at ``C`` raises the lag to at least ``C - t``, and a host
  synchronization sleeps the lag away. An operation is issued on NCCL behind the stream's work, so
  its ready time is the stream's time at its issue, not the host's. Where the host is blocked for real
  (gloo delivering the data), the stream goes on with its backlog and stands idle only for the rest
  (:meth:`Stream.blocked`).

The simulation is incremental: operations are added as they are issued (:meth:`LinkSim.add`) and
advanced only as far as a completion is asked for (:meth:`LinkSim.finish`); an operation added later is
ready no earlier than the stream's time, which is past every completion the stream has waited for, so
it never changes a completion already handed out.

Usage::

    sim = LinkSim(bandwidth={"inter": 1e9, "intra": 9e9}, fifo=True)
    op = sim.add("ep", {"inter": 4e6}, ready=0.0, latency=1e-3)
    sim.finish(op)           # 0.005: 4 ms of bytes, then 1 ms of latency
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Optional

CLASSES = ("inter", "intra")
"""The link classes: between nodes (the NIC) and inside a node (NVLink)."""

_T_EPS = 1e-9  # seconds: events closer than this are one
_B_EPS = 1e-3  # bytes: less than this left is nothing left


class Op:
    """One modelled operation: its communicator, bytes per link class, ready time and latency; the
    simulation fills ``start`` and ``done``. ``what`` names it in reports."""

    __slots__ = (
        "group",
        "remaining",
        "ready",
        "latency",
        "pred",
        "start",
        "done",
        "what",
        "nbytes",
        "info",
        "link_bytes",
    )

    def __init__(self, group: Hashable, nbytes: Dict[str, float], ready: Optional[float], latency: float):
        self.group = group
        self.nbytes = {c: float(b) for c, b in nbytes.items() if b > 0}
        """Bytes per link class (this rank's larger direction)."""
        self.remaining = dict(self.nbytes)
        self.ready = ready
        """When every rank's stream has reached it (``None``: not known yet; see :meth:`LinkSim.finish`)."""
        self.latency = latency
        """Fixed seconds after its last byte."""
        self.pred: Optional[Op] = None
        self.start: Optional[float] = None
        self.done: Optional[float] = None
        self.what = ""
        self.info: object = None
        """The caller's notes (the link model's: issue time, group name, sequence number, rank, size)."""
        self.link_bytes: object = None
        """The caller's per-peer account of the bytes (the link model's traffic counters)."""


class LinkSim:
    """The communicators and links of one rank (see the module docstring)."""

    def __init__(self, *, bandwidth: Dict[str, Optional[float]], fifo: bool = True):
        self.bandwidth = {c: bandwidth.get(c) for c in CLASSES}
        self.fifo = fifo
        self.t = 0.0
        """How far the simulation has advanced."""
        self._tail: Dict[Hashable, Op] = {}
        self._waiting: List[Op] = []
        self._active: List[Op] = []
        self._last_done = 0.0

    def add(self, group: Hashable, nbytes: Dict[str, float], *, ready: Optional[float], latency: float = 0.0) -> Op:
        """An operation issued now on communicator ``group`` (``None``: one of its own) moving ``nbytes``
        per link class, ready at ``ready`` (``None``: set it before asking for a completion)."""
        op = Op(group, nbytes, ready, latency)
        if self.fifo and group is not None:
            op.pred = self._tail.get(group)
            self._tail[group] = op
        self._waiting.append(op)
        return op

    def pending(self) -> List[Op]:
        """Operations added and not yet started in the simulation (their ready time may still be set)."""
        return list(self._waiting)

    def finish(self, op: Op) -> float:
        """Advance the simulation until ``op`` completes; return its completion. Every operation not
        started yet must have its ready time by now."""
        while op.done is None:
            if not self._step() and op.done is None:
                raise RuntimeError("link simulation stalled: an operation waits for one that never starts")
        return op.done

    def finish_all(self) -> float:
        """Advance until every operation added so far completes; return the latest completion (or the
        simulation's time when none is in flight)."""
        while self._waiting or self._active:
            if not self._step() and (self._waiting or self._active):
                raise RuntimeError("link simulation stalled")
        return max(self.t, self._last_done)

    # -------------------------------------------------------------------------- the event loop

    def _startable(self, op: Op) -> Optional[float]:
        """When ``op`` can start (``None``: its predecessor's completion is not known yet)."""
        if op.ready is None:
            raise RuntimeError(f"link simulation: the ready time of {op.what or 'an operation'} was never set")
        if op.pred is not None and op.pred.done is None:
            return None
        return max(op.ready, op.pred.done if op.pred is not None else op.ready, self.t)

    def _rates(self) -> Dict[str, Optional[float]]:
        """Bytes/s each active transfer gets on each class (``None``: unlimited)."""
        rates: Dict[str, Optional[float]] = {}
        for c in CLASSES:
            n = sum(1 for op in self._active if op.remaining.get(c, 0.0) > _B_EPS)
            bw = self.bandwidth[c]
            rates[c] = None if bw is None or n == 0 else bw / n
        return rates

    def _step(self) -> bool:
        """Advance to the next event (a start or the end of a transfer); ``False`` if there is none."""
        for op in list(self._waiting):  # start what can start now
            at = self._startable(op)
            if at is not None and at <= self.t + _T_EPS:
                self._waiting.remove(op)
                op.start = self.t
                op.pred = None  # read only before the start: the chain of a long run is not kept
                self._active.append(op)
        rates = self._rates()
        for op in list(self._active):  # unlimited classes drain at once; no bytes left: done
            for c in list(op.remaining):
                if rates[c] is None:
                    op.remaining[c] = 0.0
            if all(b <= _B_EPS for b in op.remaining.values()):
                self._complete(op)
        if not self._active and not self._waiting:
            return False
        rates = self._rates()
        nxt = [t for t in (self._startable(op) for op in self._waiting) if t is not None and t > self.t]
        for op in self._active:
            nxt += [self.t + b / rates[c] for c, b in op.remaining.items() if b > _B_EPS and rates[c]]
        if not nxt:
            # only operations whose predecessor just completed at this instant: go round again
            return any(self._startable(op) is not None for op in self._waiting)
        t_next = max(min(nxt), self.t)
        for op in self._active:
            for c, b in op.remaining.items():
                if b > _B_EPS and rates[c]:
                    ends = self.t + b / rates[c]
                    op.remaining[c] = 0.0 if ends <= t_next + _T_EPS else b - rates[c] * (t_next - self.t)
        self.t = t_next
        for op in list(self._active):
            if all(b <= _B_EPS for b in op.remaining.values()):
                self._complete(op)
        return True

    def _complete(self, op: Op) -> None:
        self._active.remove(op)
        op.done = self.t + op.latency
        self._last_done = max(self._last_done, op.done)


class Stream:
    """The device stream of one rank, as a lag behind the host (see the module docstring)."""

    def __init__(self) -> None:
        self.lag = 0.0
        """Seconds the stream is behind the host."""
        self.idle_s = 0.0
        """Seconds the stream stood waiting for operations (the exposed communication), since the
        last :meth:`reset`."""
        self.idle_by: Dict[str, float] = {}
        """``idle_s`` by what was waited for."""

    def time(self, now: float) -> float:
        """The stream's time at host time ``now`` (where an operation issued now is ready on this rank)."""
        return now + self.lag

    def wait(self, done: float, now: float, what: str = "") -> float:
        """The stream waits (at host time ``now``) for an operation completing at ``done``; returns the
        seconds it stands idle."""
        idle = max(0.0, done - (now + self.lag))
        if idle > 0:
            self.lag += idle
            self.idle_s += idle
            self.idle_by[what] = self.idle_by.get(what, 0.0) + idle
        return idle

    def blocked(self, since: float, now: float, what: str = "") -> float:
        """The host was blocked for real (gloo delivering a collective) from stream time ``since`` (the
        stream's time when the block began) to host time ``now``: the stream went on with its backlog
        meanwhile and stood idle for the rest; returns that idle time."""
        idle = max(0.0, now - since)
        self.lag = max(0.0, since - now)
        if idle > 0:
            self.idle_s += idle
            self.idle_by[what] = self.idle_by.get(what, 0.0) + idle
        return idle

    def sync(self) -> float:
        """The host catches up with the stream: returns the seconds it must block (the lag), now zero."""
        lag, self.lag = self.lag, 0.0
        return lag

    def reset(self) -> None:
        """Zero the idle counters (not the lag)."""
        self.idle_s = 0.0
        self.idle_by = {}
