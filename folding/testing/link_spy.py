"""The link model's hold on ``torch.distributed`` and on the engine's host read (tests and benchmarks only).

While :func:`spying` is active, every collective of :data:`SPIED` is reported to the link model with its
process group, its bytes per link class and its issue time, and returns a :class:`SpyWork` whose
``wait()`` tells the model that the stream waits for it (after the real wait: gloo's data must be there);
a blocking call (``async_op=False``) is an issue and a wait; ``batch_isend_irecv`` is the point-to-point
rule's (:mod:`folding.testing.link_p2p`). The engine's one device-to-host read
(:func:`folding.moe.dispatch.host_sync.to_host`) first makes the host catch up with the stream.

The functions are replaced wherever a module holds them (``torch.distributed`` and every loaded
``folding`` module: ``folding.parallel.collectives`` keeps ``all_gather_single`` under its own name), and
put back on leaving. A collective issued inside another spied one (torch's aliases) is not counted twice.

Usage::

    with spying(links):        # links: folding.testing.link_model.Links
        dist.all_reduce(t, group=g)
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import time
from typing import Any, Dict, Iterator, List, Sequence, Tuple

import torch.distributed as dist

from folding.moe.dispatch import host_sync

from . import link_p2p
from .link_model_v1 import LinkBytes

SPIED = (
    "all_reduce",
    "all_gather_into_tensor",
    "all_gather_single",
    "_all_gather_base",
    "all_gather",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "reduce_scatter",
    "all_to_all_single",
    "all_to_all",
    "broadcast",
)
"""The ``torch.distributed`` collectives the link model times (those the engine and its tests use)."""

_inside = threading.local()
_ranks: Dict[Any, Tuple[int, ...]] = {}


class SpyWork:
    """A collective's work as the model sees it: ``wait()`` waits for the real one, then tells the model
    the stream waits for it (once); anything else goes to the real work."""

    def __init__(self, work, op, links, since=None):
        self._work, self.op, self._links, self._waited, self._since = work, op, links, False, since

    def wait(self, *args, **kwargs):
        """Wait for the real collective, then make the modelled stream wait for it (no host block)."""
        since = self._links.stream_time() if self._since is None else self._since
        out = self._work.wait(*args, **kwargs) if self._work is not None else True
        if not self._waited:
            self._waited = True
            t0 = time.perf_counter()
            self._links.waited(self.op, since)
            self._links.overhead_s += time.perf_counter() - t0
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def _group_ranks(group) -> Tuple[int, ...]:
    key = group if group is not None else dist.group.WORLD
    if key not in _ranks:
        _ranks[key] = tuple(dist.get_process_group_ranks(key))
    return _ranks[key]


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def peer_bytes(kind: str, a: Dict[str, Any], n: int, me: int) -> Tuple[List[float], List[float]]:
    """``(sent, received)`` bytes per rank of the group (index ``me`` is this rank) of collective
    ``kind`` called with arguments ``a`` (see :mod:`folding.testing.link_model`'s ``bytes`` rule)."""
    if kind == "all_to_all_single":
        x, out = a["input"], a["output"]
        row_in = _nbytes(x) / max(1, x.shape[0]) if x.dim() else 0
        row_out = _nbytes(out) / max(1, out.shape[0]) if out.dim() else 0
        send = a.get("input_split_sizes") or [x.shape[0] // n] * n
        recv = a.get("output_split_sizes") or [out.shape[0] // n] * n
        return [s * row_in for s in send], [r * row_out for r in recv]
    if kind == "all_to_all":
        return [_nbytes(t) for t in a["input_tensor_list"]], [_nbytes(t) for t in a["output_tensor_list"]]
    if kind in ("all_gather_into_tensor", "all_gather_single", "_all_gather_base", "all_gather"):
        b = _nbytes(a.get("input_tensor", a.get("tensor")))
        return [b] * n, [b] * n
    if kind == "reduce_scatter":
        return [_nbytes(t) for t in a["input_list"]], [_nbytes(a["output"])] * n
    if kind in ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base"):
        return [_nbytes(a["input"]) / n] * n, [_nbytes(a["output"])] * n
    if kind == "all_reduce":
        b = 2 * _nbytes(a["tensor"]) / n
        return [b] * n, [b] * n
    if kind == "broadcast":
        src, b = a.get("group_src"), _nbytes(a["tensor"])
        if src is None:
            src = a["src"] if a.get("group") is None else dist.get_group_rank(a["group"], a["src"])
        return ([b] * n, [0.0] * n) if src == me else ([0.0] * n, [b if i == src else 0.0 for i in range(n)])
    raise ValueError(f"the link model has no byte count for {kind}")


def class_bytes(model, kind: str, a: Dict[str, Any], ranks: Sequence[int], me: int):
    """``(bytes per link class, LinkBytes)`` of collective ``kind`` with arguments ``a`` on a group of
    global ranks ``ranks`` (this rank at index ``me``), sorted by the nodes of ``model``
    (:class:`folding.testing.link_model_v1.LinkModel`): each class costs its larger direction."""
    acct = LinkBytes()
    send, recv = peer_bytes(kind, a, len(ranks), me)
    acct.add(model, ranks[me], list(ranks), send, recv)
    return {"inter": max(acct.inter_sent, acct.inter_recv), "intra": max(acct.intra_sent, acct.intra_recv)}, acct


def _spy(kind: str, real, links):
    params = inspect.signature(real).parameters
    names = list(params)
    defaults = {k: v.default for k, v in params.items() if v.default is not inspect.Parameter.empty}

    def spied(*args, **kwargs):
        if getattr(_inside, "on", False):
            return real(*args, **kwargs)
        t0 = time.perf_counter()
        a = dict(defaults)
        a.update(zip(names, args))
        a.update(kwargs)
        group = a.get("group")
        ranks = _group_ranks(group)
        if len(ranks) == 1:
            return real(*args, **kwargs)
        me = ranks.index(dist.get_rank())
        nbytes, acct = class_bytes(links.model, kind, a, ranks, me)
        key = group if group is not None else dist.group.WORLD
        op = links.issued(key, key.group_name, me, len(ranks), nbytes, kind)
        op.link_bytes = acct
        since = links.stream_time()  # a blocking call blocks the host in the real collective
        t1 = time.perf_counter()
        _inside.on = True
        try:
            work = real(*args, **kwargs)
        finally:
            _inside.on = False
        links.overhead_s += t1 - t0
        w = SpyWork(work, op, links, None if a.get("async_op") else since)
        if a.get("async_op"):
            return w
        w.wait()
        return None

    spied.__wrapped__ = real
    return spied


def _host_read(real, links):
    def to_host(*args, **kwargs):
        links.host_needs("count read")
        return real(*args, **kwargs)

    to_host.__wrapped__ = real
    return to_host


@contextlib.contextmanager
def spying(links) -> Iterator[None]:
    """Report every collective of :data:`SPIED` and the engine's host read to ``links`` inside the block."""
    wrappers: Dict[int, Any] = {}
    for kind in SPIED:
        real = getattr(dist, kind, None)
        if real is not None and id(real) not in wrappers:
            wrappers[id(real)] = _spy(kind, real, links)
    for read in (host_sync.to_host, host_sync.start_read):  # the count read starts its copy, then waits
        wrappers[id(read)] = _host_read(read, links)
    real = dist.batch_isend_irecv
    wrappers[id(real)] = link_p2p.spy_batch(real, links, publish, peer_times)
    undo = _rebind(wrappers)
    try:
        yield
    finally:
        for mod, name, real in undo:
            setattr(mod, name, real)


_TORCH_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")


def _rebind(wrappers: Dict[int, Any]) -> List[Tuple[Any, str, Any]]:
    """Replace every reference a ``torch.distributed`` or ``folding`` module holds to a wrapped function;
    return what to put back."""
    undo = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not (
            name.startswith("folding") or name in ("torch.distributed", "torch.distributed.distributed_c10d")
        ):
            continue
        for attr, val in list(vars(mod).items()):
            if callable(val) and id(val) in wrappers:
                setattr(mod, attr, wrappers[id(val)])
                undo.append((mod, attr, val))
    return undo


# -------------------------------------------------------------------- the peers' issue times


def _store():
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def publish(key: str, t: float) -> None:
    """Publish this rank's issue time of one collective (in the default group's store)."""
    _store().set(key, repr(t))


def peer_times(keys: Sequence[str], timeout_s: float = 0.0) -> List[float]:
    """The published times under ``keys`` when all are there, waiting up to ``timeout_s`` for them
    (polling with a pause growing from 50 µs to 1 ms: a peer a moment late costs about that moment);
    ``[]`` when some are still missing then."""
    if not keys:
        return []
    store, keys = _store(), list(keys)
    pause, deadline = 5e-5, time.perf_counter() + timeout_s
    while not store.check(keys):
        if time.perf_counter() >= deadline:
            return []
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
    return [float(v) for v in store.multi_get(keys)]
