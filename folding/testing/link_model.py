"""A CPU model of the links that waits the way NCCL does (benchmarks and tests only).

gloo on one machine has no network worth hiding. Inside :func:`link_model` every collective handed to
``torch.distributed`` is timed by a model of a GPU cluster's links (:mod:`folding.testing.link_sim`)
and the host is made to wait where, and only where, it would wait on NCCL. The engine imports nothing
from here: the model wraps ``torch.distributed``'s collectives and the engine's one device-to-host read
(:func:`folding.moe.dispatch.host_sync.to_host`, and ``start_read`` of the dispatchers' count read) while
it is installed, and names the token exchanges
through the overlap module's observer hook (:class:`folding.overlap.exchange.ExchangeObserver`).

The rules (``RULES``, written into the benchmarks' JSON):

- ``wait``: ``Work.wait()`` does not block the host; it makes the stream wait (NCCL). The host pays
  the stream's lag where it first needs a result: the dispatcher's count read (``to_host``), and
  :func:`sync` (the end of a step: the stream and every operation in flight).
- ``order``: every modelled collective on a process group (a communicator: its identity, not its rank
  list), whoever issues it (token exchanges, TP gathers, router all-reduces, gradient reductions), starts
  after the one issued before it there (``nccl_order``); each starts no earlier than the stream's time
  at its issue (NCCL queues it behind the stream's work) and, with ``peer_issue``, than every rank of
  its group's (each rank publishes its issue time in the default group's store).
- ``bytes``: each collective moves its bytes (this rank's larger direction per link class: NIC between
  nodes of ``nvlink_domain`` ranks, NVLink inside a node) and pays ``message_latency_s``; an EP token
  exchange (an overlap-point :class:`~folding.overlap.exchange.Exchange` named ``ep ...``) pays
  ``latency_s`` once for all its messages. ETP exchanges and the hierarchical combine's fp32
  reduce-scatter cost their bytes like any collective. Byte counts: all-to-alls their split sizes,
  gathers and scatters one block per peer, an all-reduce ``2·bytes/n`` per peer (a ring), a broadcast
  the whole tensor from its root.
- ``share``: transfers in flight at once on one link class share its bandwidth equally.

- ``p2p``: a point-to-point receive (``batch_isend_irecv``, the pipeline's) completes no earlier than
  the sender's stream reached the send, plus its bytes over the link class and ``message_latency_s``;
  NCCL runs point-to-point on communicators of their own per pair, so it is neither queued behind the
  group's collectives nor in the links' sharing (:mod:`folding.testing.link_p2p`).

Not modelled: barriers.

Usage::

    with runtime.active(), link_model(runtime, latency_s=0.01, inter_node_bandwidth=2e8, nvlink_domain=4) as links:
        links.reset()
        step()                    # waits return at once; count reads pay the stream's lag
        sync()                    # the end of the step: the host waits for the stream
    links.idle_s, links.host_s, traffic.inter_node_bytes
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Dict, Iterator, List, Optional

from folding.overlap import exchange as overlap
from folding.overlap.runtime import OverlapRuntime

from . import link_spy
from .link_model_v1 import LinkBytes, LinkModel, Traffic
from .link_sim import LinkSim, Op, Stream

__all__ = ["LinkBytes", "LinkModel", "Links", "RULES", "Traffic", "link_latency", "link_model", "sync", "traffic"]

RULES = "nccl-wait"
"""The name of this model's rules (the benchmarks' JSON ``link_rules``); ``"exchange-wait"`` is the
earlier model (:mod:`folding.testing.link_model_v1`: each EP exchange's wait sleeps until its completion,
other collectives outside the model)."""

traffic = Traffic()
"""Process-wide counters: the bytes EP token exchanges sent per link class (read by benchmarks)."""

P2P_WAIT = "p2p recv"
"""The name under which :attr:`Links.idle_by` counts the stream's waits in point-to-point receives."""

PEER_TIMEOUT_S = 5.0
"""How long a completion looks for a peer's published issue time before it uses what it has."""


@dataclasses.dataclass(eq=False)
class Links:
    """One installed model: its settings, the simulation, the stream and what the host paid."""

    model: LinkModel
    message_latency_s: float = 0.0
    """Fixed seconds of every collective message that is not an EP token exchange's."""
    host_s: float = 0.0
    """Seconds the host slept to catch up with the stream, since :meth:`reset`."""
    host_by: Dict[str, float] = dataclasses.field(default_factory=dict)
    """``host_s`` by where the host needed a result (``"count read"``, ``"end of step"``)."""
    estimated_peers: int = 0
    """Peers' issue times not yet published when a completion was needed (taken as now: that peer had
    not issued yet)."""
    overhead_s: float = 0.0
    """Host seconds spent in the model's own bookkeeping (the spy, the simulation, the store), since
    :meth:`reset`: time a GPU run would not spend."""
    missing_peers: int = 0
    """Of those, the ones of a completed collective or one before it on its group (which every peer
    had issued: zero unless a peer issues collectives outside the model)."""

    def __post_init__(self):
        m = self.model
        self.sim = LinkSim(
            bandwidth={"inter": m.inter_node_bandwidth, "intra": m.intra_node_bandwidth}, fifo=m.nccl_order
        )
        self.stream = Stream()
        self.lock = threading.RLock()
        self.session = _next_session()
        self.seq: Dict[str, int] = {}

    @property
    def idle_s(self) -> float:
        """Seconds the stream stood waiting for collectives (the exposed communication), since :meth:`reset`."""
        return self.stream.idle_s

    @property
    def idle_by(self) -> Dict[str, float]:
        """``idle_s`` by what the stream waited for (an exchange's name, or the collective's kind)."""
        return dict(self.stream.idle_by)

    def reset(self) -> None:
        """Zero what the host and the stream paid (not the state of the links)."""
        self.stream.reset()
        self.host_s, self.host_by, self.estimated_peers, self.missing_peers = 0.0, {}, 0, 0
        self.overhead_s = 0.0

    def rules(self) -> dict:
        """The rules in force, for a report (:func:`rules`)."""
        return rules(self.model, self.message_latency_s)

    # ------------------------------------------------------------------ called by the spy

    def issued(self, group_key, name: str, rank: int, size: int, nbytes: Dict[str, float], kind: str) -> Op:
        """A collective was issued now by this rank (index ``rank`` of ``size`` in group ``name``)."""
        with self.lock:
            own = self.stream.time(time.perf_counter())
            op = self.sim.add(group_key, nbytes, ready=None if self.model.peer_issue else own)
            op.latency = self.message_latency_s
            op.what = kind
            seq = self.seq.get(name, 0)
            self.seq[name] = seq + 1
            op.info = (own, name, seq, rank, size)
        if self.model.peer_issue:
            link_spy.publish(self._key(name, seq, rank), own)
        return op

    def stream_time(self) -> float:
        """The stream's time now (taken before the host blocks in a real collective)."""
        return self.stream.time(time.perf_counter())

    def waited(self, op: Op, since: float) -> None:
        """The stream waits for ``op``, whose real collective has completed (every peer issued it) after
        the host was blocked in it from stream time ``since``."""
        with self.lock:
            self.stream.blocked(since, time.perf_counter(), op.what)
            self._set_ready(chain=op)
            self.stream.wait(self.sim.finish(op), time.perf_counter(), op.what)

    def received(self, done: float, since: float) -> None:
        """The stream waits for point-to-point data arriving at ``done`` (:mod:`folding.testing.link_p2p`),
        the host having been blocked in the real transfer from stream time ``since``."""
        with self.lock:
            self.stream.blocked(since, time.perf_counter(), P2P_WAIT)
            self.stream.wait(done, time.perf_counter(), P2P_WAIT)

    def host_needs(self, reason: str, *, everything: bool = False) -> float:
        """The host needs a result: it sleeps until the stream catches up (``everything``: and every
        operation in flight completes, as at the end of a step); returns the seconds slept."""
        with self.lock:
            if everything:
                since = self.stream_time()
                self._set_ready(chain=None)  # may wait for a peer to publish (real time)
                self.stream.blocked(since, time.perf_counter(), "end of step")
                self.stream.wait(self.sim.finish_all(), time.perf_counter(), "end of step")
            lag = self.stream.sync()
            if lag > 0:
                self.host_s += lag
                self.host_by[reason] = self.host_by.get(reason, 0.0) + lag
        if lag > 0:
            time.sleep(lag)
        return lag

    def _key(self, name: str, seq: int, rank: int) -> str:
        return f"folding/link2/{self.session}/{name}/{seq}/{rank}"

    def _set_ready(self, chain: Optional[Op]) -> None:
        """Ready times of the operations not started yet: the latest of their ranks' issue times. Every
        rank publishes before it issues, so the peers' times of ``chain`` (whose real collective has
        completed) and of the ones before it on its group are there; an operation of another group
        whose peers have not all published is taken as issued by them now (``chain=None``, at the end
        of a step: wait up to ``PEER_TIMEOUT_S`` for every one)."""
        need, everything = set(), chain is None
        while chain is not None and chain.start is None:  # a started operation's predecessors are done
            need.add(id(chain))
            chain = chain.pred
        for op in self.sim.pending():
            if op.ready is not None:
                continue
            own, name, seq, rank, size = op.info
            keys = [self._key(name, seq, i) for i in range(size) if i != rank]
            times = link_spy.peer_times(keys, PEER_TIMEOUT_S if everything else 0.0)
            if len(times) < len(keys):
                self.estimated_peers += len(keys) - len(times)
                if id(op) in need:
                    self.missing_peers += len(keys) - len(times)
                times.append(time.perf_counter())
            op.ready = max([own, *times])

    def tag(self, ex: overlap.Exchange) -> None:
        """Name the collectives of exchange ``ex``; an EP token exchange's first one pays ``latency_s``."""
        ops: List[Op] = [w.op for w in ex.works if isinstance(w, link_spy.SpyWork)]
        with self.lock:
            for op in ops:
                op.what = ex.what
            if ops and ex.overlap_point and ex.what.startswith("ep"):
                ops[0].latency = self.model.latency_s
                for op in ops:
                    if op.link_bytes is not None:
                        traffic.record(op.link_bytes)


def rules(model: LinkModel, message_latency_s: float = 0.0) -> dict:
    """The rules a model with these settings keeps, for a report's JSON (see the module docstring)."""
    return dict(
        link_rules=RULES,
        wait_blocks_host=False,
        host_pays_at=["count read", "end of step"],
        nccl_order=model.nccl_order,
        order="every modelled collective, per communicator" if model.nccl_order else "none",
        peer_issue=model.peer_issue,
        exchange_latency_s=model.latency_s,
        message_latency_s=message_latency_s,
        inter_node_bandwidth=model.inter_node_bandwidth,
        intra_node_bandwidth=model.intra_node_bandwidth,
        nvlink_domain=model.nvlink_domain,
        bandwidth="shared equally by the transfers in flight on a link class",
        modelled=list(link_spy.SPIED),
        point_to_point="batch_isend_irecv: a receive's stream waits for the sender's stream at the send plus "
        "the bytes over the link class (a communicator per pair: no queue, no sharing)",
        not_modelled=["barrier"],
    )


_sessions = [0]


def _next_session() -> int:
    _sessions[0] += 1
    return _sessions[0]


class _Names(overlap.ExchangeObserver):
    def __init__(self, links: Links):
        self.links = links

    def issued(self, ex: overlap.Exchange) -> None:
        self.links.tag(ex)


_installed: List[Links] = []


@contextlib.contextmanager
def link_model(
    runtime: OverlapRuntime,
    *,
    latency_s: float = 0.0,
    message_latency_s: float = 0.0,
    inter_node_bandwidth: Optional[float] = None,
    intra_node_bandwidth: Optional[float] = None,
    nvlink_domain: Optional[int] = None,
    nccl_order: bool = True,
    peer_issue: bool = True,
) -> Iterator[Links]:
    """Inside the block every collective is timed by the model and the host waits where NCCL's would
    (see the module docstring); yields the :class:`Links`. ``runtime``: the overlap runtime whose exchanges
    name the spied collectives (:meth:`~folding.overlap.runtime.OverlapRuntime.observe`). ``latency_s``: each
    EP token exchange's fixed time; ``message_latency_s``: every other collective message's."""
    if message_latency_s < 0:
        raise ValueError(f"message_latency_s must be >= 0 seconds, got {message_latency_s}")
    m = LinkModel(
        latency_s=float(latency_s),
        inter_node_bandwidth=inter_node_bandwidth,
        intra_node_bandwidth=intra_node_bandwidth,
        nvlink_domain=nvlink_domain,
        nccl_order=nccl_order,
        peer_issue=peer_issue,
    )
    if _installed:
        raise RuntimeError("link_model: a link model is already installed in this process")
    links = Links(m, message_latency_s=float(message_latency_s))
    _installed.append(links)
    try:
        with link_spy.spying(links), runtime.observe(_Names(links)):
            yield links
    finally:
        _installed.remove(links)


@contextlib.contextmanager
def link_latency(
    runtime: OverlapRuntime, seconds: float, *, nccl_order: bool = True, peer_issue: bool = True
) -> Iterator[Links]:
    """:func:`link_model` with only the EP token exchanges' fixed time ``seconds`` (no bandwidth limit,
    other collectives free but in their communicators' order)."""
    with link_model(runtime, latency_s=seconds, nccl_order=nccl_order, peer_issue=peer_issue) as links:
        yield links


def sync(reason: str = "end of step") -> float:
    """The host waits for the stream and every collective in flight (a step's end); returns the
    seconds it slept (0 outside a model)."""
    return _installed[0].host_needs(reason, everything=True) if _installed else 0.0


def current() -> Optional[Links]:
    """The installed model, or ``None``."""
    return _installed[0] if _installed else None
