"""A two-class CPU model of the links a token exchange uses (benchmarks and tests only).

It subscribes to the exchanges of an overlap runtime
(:meth:`folding.overlap.runtime.OverlapRuntime.observe`) and reads what each exchange record carries
(:class:`folding.overlap.exchange.Exchange`: its kind, group and messages): the engine imports nothing
from here and passes it nothing.

On a GPU cluster an exchange's rows to ranks of other nodes go over the NIC (about 50 GB/s per GPU per
direction on H100) and those to ranks of the same node over NVLink (about 450 GB/s): nine times
faster. On one CPU machine every rank shares the same memory, so nothing shows the difference. Inside
:func:`link_model`, every EP token exchange (``carries`` :data:`~folding.overlap.exchange.TOKENS`)
completes no earlier than

    start + latency + max over the link classes it uses of (its bytes on that class / that class's bandwidth)

(the two classes are separate links and carry their bytes at the same time; on each, a rank's bytes are
the larger of what it sends and what it receives there, each direction having its own bandwidth). Its
wait sleeps for the rest (no CPU used): the exchange's data and order are unchanged.

**NCCL's order** (``nccl_order``, on by default): NCCL runs the operations of one communicator one after
another, whatever stream they are issued on, so an operation on a process group completes no earlier
than every operation issued before it on that group (a small count all-gather issued after a large
all-to-all on the same group completes after it). The model keeps, per process group, the modelled
completion of the last operation issued there (:func:`issue`); an operation's completion is the later
of its own and that one. gloo does not serialize them, so without this rule no CPU measurement shows
what sharing a communicator costs. A separate process group over the same ranks is a separate
communicator and has its own order.

**The last sender** (``peer_issue``, on by default): a rank receives a peer's bytes only after that peer
sent them, so an exchange completes no earlier than its duration after the *last* of its group's ranks
issued it, not after this rank did. Each rank publishes the time it issued every modelled exchange in
the process group's key-value store (``dist.distributed_c10d._get_default_store``), keyed by the group's
name and the exchange's index on that group (every rank issues a group's exchanges in the same order),
and the wait reads its peers' times (:func:`_await`: a peer that publishes a moment late costs about that
moment). The ranks share one clock (``time.perf_counter``, the host's
monotonic clock: the model is for ranks on one machine). Without the rule a rank that issued early
would see its exchange complete before a late peer had sent anything, and the ranks' skew would
surface at the next collective the model does not delay (the token counts' all-gather) instead of in
the exchange where a network would absorb it. A peer's time not published within
``PEER_TIMEOUT_S`` (an exchange only some ranks observe) falls back to this rank's own, counted in
:data:`traffic`. Two ranks are on
the same node when their *global* ranks agree after integer division by ``nvlink_domain`` (``parallel.
nvlink_domain``); rows a rank sends to itself are a local copy and cost nothing.

:func:`link_latency` (latency only, every exchange alike) is the one-class model it extends.

:data:`traffic` accumulates the bytes each class carried (sent by this process) while a model is active:
the counts a benchmark reports.

Usage::

    runtime = OverlapRuntime()
    with runtime.active(), link_model(runtime, latency_s=1e-3, inter_node_bandwidth=2e8,
                                      intra_node_bandwidth=1.8e9, nvlink_domain=4):
        layer(x).sum().backward()          # every EP exchange waits for its modelled completion
    traffic.inter_node_bytes, traffic.intra_node_bytes
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch.distributed as dist

from folding.overlap import exchange as overlap
from folding.overlap.runtime import OverlapRuntime


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkModel:
    """The links' settings (a bandwidth of ``None`` is unlimited)."""

    latency_s: float = 0.0
    """Fixed time of every exchange, seconds."""
    inter_node_bandwidth: Optional[float] = None
    """Bytes/s per rank per direction between ranks of different nodes (the NIC)."""
    intra_node_bandwidth: Optional[float] = None
    """Bytes/s per rank per direction between ranks of one node (NVLink)."""
    nvlink_domain: Optional[int] = None
    """Ranks per node (global rank // this = node); ``None``: every rank on one node."""
    nccl_order: bool = True
    """An operation on a process group completes no earlier than every operation issued before it on
    that group (NCCL's one communicator, one order; see the module docstring)."""
    peer_issue: bool = True
    """An exchange completes no earlier than its duration after the last of its group's ranks issued it
    (see the module docstring); ``False``: after this rank issued it."""

    def __post_init__(self):
        if self.latency_s < 0:
            raise ValueError(f"link latency must be >= 0 seconds, got {self.latency_s}")
        for name in ("inter_node_bandwidth", "intra_node_bandwidth"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be > 0 bytes/s (or None: unlimited), got {v}")
        if self.nvlink_domain is not None and self.nvlink_domain < 1:
            raise ValueError(f"nvlink_domain must be >= 1, got {self.nvlink_domain}")

    def node(self, global_rank: int) -> int:
        """The node of a global rank."""
        return 0 if self.nvlink_domain is None else global_rank // self.nvlink_domain

    def duration(self, inter_bytes: float, intra_bytes: float) -> float:
        """Seconds an exchange moving ``inter_bytes`` across nodes and ``intra_bytes`` inside a node (per
        rank, the larger direction) lasts at least: latency + the slower class's bytes over its bandwidth."""
        t = 0.0
        for nbytes, bw in ((inter_bytes, self.inter_node_bandwidth), (intra_bytes, self.intra_node_bandwidth)):
            if nbytes > 0 and bw is not None:
                t = max(t, nbytes / bw)
        return self.latency_s + t

    @property
    def active(self) -> bool:
        """Whether the model delays anything."""
        return self.latency_s > 0 or self.inter_node_bandwidth is not None or self.intra_node_bandwidth is not None


@dataclasses.dataclass
class LinkBytes:
    """One rank's bytes of one exchange per link class: sent and received."""

    inter_sent: float = 0.0
    """Bytes sent to ranks of other nodes."""
    inter_recv: float = 0.0
    """Bytes received from ranks of other nodes."""
    intra_sent: float = 0.0
    """Bytes sent to other ranks of this node."""
    intra_recv: float = 0.0
    """Bytes received from other ranks of this node."""

    def add(self, model: LinkModel, me: int, peers: Sequence[int], send_bytes, recv_bytes) -> None:
        """Count one uneven all-to-all: ``send_bytes[i]`` / ``recv_bytes[i]`` to / from the rank of global
        rank ``peers[i]``; ``me`` is this rank's global rank (its own share is a local copy)."""
        here = model.node(me)
        for peer, s, r in zip(peers, send_bytes, recv_bytes):
            if peer == me:
                continue
            if model.node(peer) == here:
                self.intra_sent += s
                self.intra_recv += r
            else:
                self.inter_sent += s
                self.inter_recv += r

    def duration(self, model: LinkModel) -> float:
        """:meth:`LinkModel.duration` of these bytes (each class's larger direction)."""
        return model.duration(max(self.inter_sent, self.inter_recv), max(self.intra_sent, self.intra_recv))


@dataclasses.dataclass
class Traffic:
    """Bytes this process sent per link class in modelled exchanges since the last :meth:`reset`."""

    inter_node_bytes: float = 0.0
    """Sent to ranks of other nodes."""
    intra_node_bytes: float = 0.0
    """Sent to other ranks of this node."""
    exchanges: int = 0
    """Modelled exchanges."""
    peer_fallbacks: int = 0
    """Peers' issue times not published within ``PEER_TIMEOUT_S`` (this rank's own time used instead)."""

    def reset(self) -> None:
        """Zero the counters."""
        self.inter_node_bytes = self.intra_node_bytes = 0.0
        self.exchanges = self.peer_fallbacks = 0

    def record(self, b: LinkBytes) -> None:
        """Add one exchange's bytes."""
        self.inter_node_bytes += b.inter_sent
        self.intra_node_bytes += b.intra_sent
        self.exchanges += 1


traffic = Traffic()
"""Process-wide counters of the bytes modelled exchanges sent (read by benchmarks)."""

_model = [LinkModel()]
_tails: Dict[Any, float] = {}  # process group -> modelled completion of the last operation issued on it
_pending: Dict[Any, List[overlap.Exchange]] = {}  # process group -> exchanges issued there, not yet settled
_settled: Dict[Any, float] = {}  # process group -> final modelled completion of its last settled exchange
_seq: Dict[str, int] = {}  # process group name -> modelled exchanges issued there by this process

PEER_TIMEOUT_S = 5.0
"""How long a wait looks for a peer's published issue time before it uses this rank's own."""


def current() -> LinkModel:
    """The link model in force (inactive outside :func:`link_model` / :func:`link_latency`)."""
    return _model[0]


@contextlib.contextmanager
def link_model(
    runtime: OverlapRuntime,
    *,
    latency_s: float = 0.0,
    inter_node_bandwidth: Optional[float] = None,
    intra_node_bandwidth: Optional[float] = None,
    nvlink_domain: Optional[int] = None,
    nccl_order: bool = True,
    peer_issue: bool = True,
) -> Iterator[LinkModel]:
    """Inside the block, every EP token exchange of ``runtime`` completes no earlier than its
    :meth:`LinkModel.duration` after it was issued and, with ``nccl_order``, no earlier than every
    operation issued before it on its process group and, with ``peer_issue``, no earlier than its
    duration after the last of its ranks issued it (see the module docstring); yields the
    :class:`LinkModel`."""
    m = LinkModel(
        latency_s=float(latency_s),
        inter_node_bandwidth=inter_node_bandwidth,
        intra_node_bandwidth=intra_node_bandwidth,
        nvlink_domain=nvlink_domain,
        nccl_order=nccl_order,
        peer_issue=peer_issue,
    )
    old, _model[0] = _model[0], m
    saved = (dict(_tails), dict(_pending), dict(_settled))
    for d in (_tails, _pending, _settled):
        d.clear()
    try:
        with runtime.observe(_Links(m)):
            yield m
    finally:
        _model[0] = old
        for d, was in zip((_tails, _pending, _settled), saved):
            d.clear()
            d.update(was)


@contextlib.contextmanager
def link_latency(
    runtime: OverlapRuntime, seconds: float, *, nccl_order: bool = True, peer_issue: bool = True
) -> Iterator[None]:
    """Link model for benchmarks and tests: inside the block, every token exchange of ``runtime``
    completes no earlier than ``seconds`` after it was issued (its wait sleeps for the rest, using no CPU), as on a
    network with that latency after the last of its ranks issued it (``peer_issue``), and
    (``nccl_order``) no earlier than the operations issued before it on its process group. The
    exchanges' data and order are unchanged."""
    with link_model(runtime, latency_s=seconds, nccl_order=nccl_order, peer_issue=peer_issue):
        yield


def issue(group, duration: float) -> Optional[float]:
    """Record an operation issued now on process group ``group`` that lasts at least ``duration``
    seconds; return the ``time.perf_counter()`` at which it completes in the model: the later of now +
    ``duration`` and (under ``nccl_order``) the completion of the last operation issued on ``group``
    before it. ``group=None``: a group the caller does not name (no order kept). ``None`` when no model
    is active."""
    m = _model[0]
    if not m.active:
        return None
    done = time.perf_counter() + duration
    if m.nccl_order and group is not None:
        done = max(done, _tails.get(group, 0.0))
        _tails[group] = done
    return done


def complete(done: Optional[float]) -> float:
    """Sleep (no CPU) until the modelled completion ``done`` of :func:`issue`; return the seconds slept."""
    if done is None:
        return 0.0
    rest = done - time.perf_counter()
    if rest > 0:
        time.sleep(rest)
        return rest
    return 0.0


class _Links(overlap.ExchangeObserver):
    """The model's hold on every exchange: its modelled completion when issued (with its bytes per
    link class, for an EP exchange; its issue time published for its peers), then, when its collectives
    have completed, the completion corrected by the peers' issue times and the group's order, and a
    sleep until then."""

    def __init__(self, model: LinkModel):
        self.model = model

    def issued(self, ex: overlap.Exchange) -> None:
        duration = 0.0
        if ex.carries == overlap.TOKENS and self.model.active:
            link_bytes = priced(ex.messages)
            duration = self.model.latency_s if link_bytes is None else link_bytes.duration(self.model)
            if link_bytes is not None:
                traffic.record(link_bytes)
        ex.marks["link_done"] = issue(ex.group, duration)
        if ex.marks["link_done"] is None:
            return
        if self.model.peer_issue and duration > 0:
            _publish(ex, duration)
        if self.model.nccl_order and ex.group is not None:
            _pending.setdefault(ex.group, []).append(ex)

    def settle(self, ex: overlap.Exchange) -> None:
        _resolve(ex, self.model.nccl_order)
        complete(completion(ex))


def _group_of(group):
    """``(store, group name, this rank's index in it, its size)`` of ``group`` (``None``: the world), or
    ``None`` when ``torch.distributed`` is not initialized."""
    if not dist.is_initialized():
        return None
    from torch.distributed import distributed_c10d as c10d

    pg = group if group is not None else c10d._get_default_group()
    return c10d._get_default_store(), pg.group_name, dist.get_rank(pg), dist.get_world_size(pg)


def _key(name: str, seq: int, index: int) -> str:
    return f"folding/link/{name}/{seq}/{index}"


def _publish(ex: overlap.Exchange, duration: float) -> None:
    """Publish when this rank issued ``ex`` (in the group's store) and note what its peers will publish."""
    g = _group_of(ex.group)
    if g is None or g[3] == 1:
        return
    store, name, me, size = g
    seq = _seq.get(name, 0)
    _seq[name] = seq + 1
    store.set(_key(name, seq, me), repr(ex.start))
    ex.marks["link_peers"] = (store, name, seq, me, size, duration)


def _last_issue(store, name: str, seq: int, me: int, size: int, own: float) -> float:
    """The latest time any rank of the group issued its exchange number ``seq`` (``own``: this rank's)."""
    keys = [_key(name, seq, i) for i in range(size) if i != me]
    published = _await(store, keys, PEER_TIMEOUT_S)
    if len(published) < len(keys):  # not published: an exchange some peer does not observe
        traffic.peer_fallbacks += len(keys) - len(published)
    if not published:
        return own
    return max([own, *(float(v) for v in store.multi_get(published))])


def _await(store, keys: List[str], timeout_s: float) -> List[str]:
    """Wait until every key of ``keys`` is in ``store`` (at most ``timeout_s``); return those that are.

    Polls ``store.check`` with a pause that grows from 50 µs to 1 ms: a peer that publishes a moment
    late costs about that moment. (The file store behind the test ranks' default group polls every
    10 ms inside its own ``wait``: a peer 0.5 ms late cost this rank 10 to 11 ms, which the model then
    counted as time the exchange was exposed.)"""
    pause, deadline = 5e-5, time.perf_counter() + timeout_s
    while not store.check(keys):
        if time.perf_counter() > deadline:
            return [k for k in keys if store.check([k])]
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
    return keys


def _resolve(ex: overlap.Exchange, nccl_order: bool) -> None:
    """Final modelled completions of ``ex`` and of the exchanges issued before it on its group: each no
    earlier than its duration after the last rank issued it and than the one before it there."""
    pending = _pending.get(ex.group, []) if nccl_order and ex.group is not None else []
    if ex in pending:
        n = pending.index(ex) + 1
        upto, pending[:n] = pending[:n], []
    else:
        upto = [ex]
    for e in upto:
        done = e.marks.get("link_done")
        if done is None or e.marks.get("link_final"):
            continue
        peers = e.marks.pop("link_peers", None)
        if peers is not None:
            store, name, seq, me, size, duration = peers
            done = max(done, _last_issue(store, name, seq, me, size, e.start) + duration)
        if nccl_order and e.group is not None:
            done = max(done, _settled.get(e.group, 0.0))
            _settled[e.group] = done
        e.marks["link_done"] = done
        e.marks["link_final"] = True


def completion(ex: overlap.Exchange) -> Optional[float]:
    """The modelled completion of exchange ``ex`` (:func:`issue`'s), ``None`` when none was modelled."""
    return ex.marks.get("link_done")


def priced(messages) -> Optional[LinkBytes]:
    """An exchange's bytes per link class: its :class:`~folding.overlap.exchange.Message` records sorted
    by the node of each peer, or ``messages`` itself when a :class:`LinkBytes` (a test's exchange with
    no process group); ``None`` when nothing was recorded or ``torch.distributed`` is not initialized
    (the latency alone applies)."""
    if isinstance(messages, LinkBytes):
        return messages
    if not messages or not dist.is_initialized():
        return None
    acc, me = LinkBytes(), dist.get_rank()
    for m in messages:
        peers = dist.get_process_group_ranks(m.group if m.group is not None else dist.group.WORLD)
        acc.add(_model[0], me, peers, m.send_bytes, m.recv_bytes)
    return acc
