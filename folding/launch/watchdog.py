"""Lost peers and a lost launcher: a worker never hangs on a dead job, nor outlives its torchrun.

Two guards that :func:`folding.launch.run.run_job` sets up for every worker:

- :func:`exit_with_launcher` (under torchrun): torchrun starts each worker in a session of its own, so a
  torchrun killed with SIGKILL (or a node agent that crashes) would leave its workers running, holding
  their GPUs and ports. The worker asks the kernel for SIGKILL when its parent dies (Linux
  ``PR_SET_PDEATHSIG``), and a thread that checks the parent once a second ends it where that is missing.
- :class:`PeerWatch` (a world of more than one rank): every rank refreshes a heartbeat key in the job's
  TCP store (the one torchrun's rendezvous serves: ``MASTER_ADDR:MASTER_PORT``) every ``interval_s``
  seconds (a tenth of ``stale_s``, at most 10), with its node (torchrun's ``GROUP_RANK``) and host, and
  reads every other rank's. A rank whose heartbeat has not changed for ``stale_s`` seconds (half of
  ``train.collective_timeout_s``) is lost:
  the watching rank prints one line, ``error (rank 0): lost rank 3 (node 1, host gpu-b): no heartbeat for
  5.2 s (train.collective_timeout_s=10): exiting``, and exits with status :data:`LOST_PEER_EXIT`, even
  from inside a collective that would otherwise wait out the timeout (or forever, on a link that never
  fails). Change is judged on this rank's clock only, so clocks of other nodes do not matter. A rank that
  finishes marks its key ``done`` (never lost); a store that stops answering for ``stale_s`` is lost too
  (it lives in node 0's torchrun). When the training loop's own collective fails first (gloo sees a
  closed connection at once), :meth:`PeerWatch.verdict` waits for the watch to name the lost rank (a
  heartbeat unchanged for two rounds and a half then suffices: the death is known), so the run reports the
  same line and ends through its normal error path (``status.json`` ``failed``).

Usage::

    exit_with_launcher()                                   # first thing in a worker
    watch = PeerWatch.start_for_world(timeout_s=job.train.collective_timeout_s)   # after init_world
    ...
    line = watch.verdict()      # after a collective raised: the lost-peer line, or None
    watch.close(done=True)      # a rank that ends normally
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

import torch.distributed as dist

LOST_PEER_EXIT = 3
"""Exit status of a worker that lost a peer rank or the job's store."""
_DONE = "done"
_PR_SET_PDEATHSIG = 1


def exit_with_launcher(poll_s: float = 1.0) -> bool:
    """Under torchrun (``TORCHELASTIC_RUN_ID`` set): end this process when its parent, the torchrun agent,
    ends (Linux: ``PR_SET_PDEATHSIG`` SIGKILL; everywhere: a daemon thread polling the parent's pid every
    ``poll_s`` seconds, which prints one line and exits with :data:`LOST_PEER_EXIT`). A worker already
    orphaned when it gets here (its parent is process 1, and process 1 is no torchrun) exits at once; one
    adopted by a subreaper other than process 1 before this call is not recognized, so the entry point calls
    this first. Returns whether a guard was installed (not under torchrun: none, the process belongs to
    whoever started it); idempotent."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    if _GUARDED:  # the next job of a Hydra multirun in the same worker
        return True
    _GUARDED.append(True)
    parent = os.getppid()
    if parent == 1 and not _torchrun_is_init():  # torchrun died before this worker got here
        _print_line("torchrun that started this worker is gone: exiting")
        os._exit(LOST_PEER_EXIT)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except (OSError, AttributeError):  # not Linux: the thread below
        pass

    def watch_parent() -> None:
        while True:
            if os.getppid() != parent:
                _print_line(f"torchrun (pid {parent}) that started this worker is gone: exiting")
                os._exit(LOST_PEER_EXIT)
            time.sleep(poll_s)

    threading.Thread(target=watch_parent, name="folding-parent-watch", daemon=True).start()
    return True


_GUARDED: List[bool] = []


def _torchrun_is_init() -> bool:
    """Whether process 1 is torchrun itself (a container whose command is torchrun), where a parent pid of 1
    does not mean that this worker was orphaned. Unreadable: assume so (never end a worker on a guess)."""
    try:
        with open("/proc/1/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return True
    return b"torch" in cmd


def report_lost(message: str) -> None:
    """Print ``error (rank R): message`` on stderr (the lost-peer or lost-launcher line)."""
    _print_line(message)


def _print_line(message: str) -> None:
    rank = os.environ.get("RANK", "0")
    try:
        print(f"error (rank {rank}): {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # a closed stream: exit all the same
        pass


class PeerWatch:
    """Heartbeats in a store and the verdict on lost peers (see the module docstring).

    ``store``: a store every rank reaches (keys are set under this run's prefix by the caller);
    ``timeout_s``: ``train.collective_timeout_s`` (a peer is lost after ``stale_s = timeout_s / 2``; one that
    never set a heartbeat, ``stale_s`` after this watch first looked); ``where``: the store's address, for the
    line;
    ``on_lost``: called with the line before the process exits from the watch thread (rank 0 writes
    ``status.json`` there); ``exit``: how the watch thread ends the process (tests replace it).
    """

    def __init__(
        self,
        store,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        node: str = "?",
        host: str = "?",
        where: str = "",
        interval_s: Optional[float] = None,
        on_lost: Optional[Callable[[str], None]] = None,
        exit: Callable[[int], None] = os._exit,
    ):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, float(timeout_s)
        self.stale_s = self.timeout_s / 2
        self.interval_s = interval_s if interval_s is not None else min(max(self.stale_s / 10, 0.2), 10.0)
        self.node, self.host, self.where, self.on_lost, self._exit = node, host, where, on_lost, exit
        self._count = 0
        self._seen: Dict[int, tuple] = {}  # rank -> (value, this clock's time it last changed)
        self._store_failing_since: Optional[float] = None
        self._line: Optional[str] = None
        self._found = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._main_waits = False
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def start_for_world(cls, *, timeout_s: float, on_lost: Optional[Callable[[str], None]] = None):
        """The watch of this worker in the initialized world, started; ``None`` in a world of one rank.
        Its store is a client of ``MASTER_ADDR:MASTER_PORT`` with keys under this launch attempt and job."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if world == 1:
            return None
        stale = datetime.timedelta(seconds=max(float(timeout_s) / 2, 1.0))
        client = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, is_master=False, timeout=stale
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        prefix = f"folding/heartbeat/{run}/attempt_{attempt}/{_next_job()}/"
        watch = cls(
            dist.PrefixStore(prefix, client),
            rank=rank,
            world_size=world,
            timeout_s=timeout_s,
            node=os.environ.get("GROUP_RANK", "?"),
            host=socket.gethostname(),
            where=f" at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            on_lost=on_lost,
        )
        watch.start()
        return watch

    def start(self) -> None:
        """Set this rank's first heartbeat and start the watch thread."""
        self._beat()
        self._thread = threading.Thread(target=self._run, name="folding-peer-watch", daemon=True)
        self._thread.start()

    def check(self, now: Optional[float] = None) -> Optional[str]:
        """One round: refresh this rank's heartbeat, read the others', and return the lost-peer line (or
        ``None``). ``now``: this rank's monotonic clock (tests pass it)."""
        now = time.monotonic() if now is None else now
        try:
            self._beat()
            peers = [r for r in range(self.world_size) if r != self.rank]
            values = self._read(peers)
        except Exception as e:  # the store is gone or does not answer
            since = self._store_failing_since = self._store_failing_since or now
            if now - since < self.stale_s:
                return None
            return (
                f"lost the job's store{self.where} (torchrun of node 0): it has not answered for {now - since:.1f} s "
                f"(train.collective_timeout_s={self.timeout_s:g}; {type(e).__name__}): exiting"
            )
        self._store_failing_since = None
        lost: List[tuple] = []
        for r, value in zip(peers, values):
            old = self._seen.get(r)
            if old is None or old[0] != value:
                self._seen[r] = (value, now)
            elif value != _DONE and now - old[1] >= self._patience():
                lost.append((r, value, now - old[1]))
        if not lost:
            return None
        nodes = sorted({_field(v, 1) for _, v, _ in lost})
        hosts = sorted({_field(v, 2) for _, v, _ in lost})
        ranks = ", ".join(str(r) for r, _, _ in lost)
        age = max(a for _, _, a in lost)
        return (
            f"lost rank{'s' if len(lost) > 1 else ''} {ranks} (node{'s' if len(nodes) > 1 else ''} "
            f"{', '.join(nodes)}, host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)}): no heartbeat for "
            f"{age:.1f} s (train.collective_timeout_s={self.timeout_s:g}): exiting"
        )

    def _patience(self) -> float:
        """How long a heartbeat may stay unchanged: ``stale_s``; once a collective of this rank has failed
        (:meth:`verdict`), two rounds and a half (a live peer beats every round; the death is known, only
        the name is wanted)."""
        return min(self.stale_s, 2.5 * self.interval_s) if self._main_waits else self.stale_s

    def verdict(self, wait_s: Optional[float] = None) -> Optional[str]:
        """After a collective of this rank failed: wait up to ``wait_s`` seconds (default: four rounds, see
        :meth:`_patience`) for the watch to find a lost peer, and return its line (the watch thread then leaves
        the exit to the caller), or ``None`` when every peer is alive (the failure is another one)."""
        with self._lock:
            self._main_waits = True
            if self._line is not None:
                return self._line
        self._found.wait(min(self.stale_s, 2.5 * self.interval_s) + 1.5 * self.interval_s if wait_s is None else wait_s)
        return self._line

    def close(self, *, done: bool) -> None:
        """Stop the watch thread; with ``done`` mark this rank's heartbeat ``done`` (it finished: never lost)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
        if done:
            try:
                self.store.set(str(self.rank), _DONE)
            except Exception:  # the store is gone: nobody is left to read the mark
                pass

    def _beat(self) -> None:
        self._count += 1
        self.store.set(str(self.rank), f"{self._count} {self.node} {self.host}")

    def _read(self, ranks: List[int]) -> List[str]:
        """Each rank's heartbeat value; ``""`` for one that has set none yet (never a blocking read)."""
        unknown = [r for r in ranks if r not in self._seen or self._seen[r][0] == ""]
        absent = {r for r in unknown if not self.store.check([str(r)])}
        present = [r for r in ranks if r not in absent]
        if hasattr(self.store, "multi_get"):
            got = [v.decode() for v in self.store.multi_get([str(r) for r in present])] if present else []
        else:
            got = [self.store.get(str(r)).decode() for r in present]
        values = dict(zip(present, got))
        return [values.get(r, "") for r in ranks]

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            line = self.check()
            if line is None:
                continue
            with self._lock:
                self._line = line
                self._found.set()
                if self._main_waits:  # the training loop's collective failed: it reports and exits
                    return
            _print_line(line)
            if self.on_lost is not None:
                try:
                    self.on_lost(line)
                except Exception:  # the exit must not depend on the report
                    pass
            self._exit(LOST_PEER_EXIT)
            return


_COMM_WORDS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "broken pipe", "by peer")


def collective_failure(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) is a failed communication: a ``torch.distributed`` error, or the
    ``RuntimeError`` gloo raises (``Connection closed by peer``, ``Timed out waiting``). For those the run
    waits for the peer watch's verdict; any other error is reported at once."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, dist.DistError) or (
            isinstance(e, RuntimeError) and any(w in str(e).lower() for w in _COMM_WORDS)
        ):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _field(value: str, k: int) -> str:
    parts = value.split(" ")
    return parts[k] if len(parts) > k else "?"


_JOBS = [0]


def _next_job() -> str:
    """A key prefix per watch in this process (each job of a Hydra multirun starts one)."""
    _JOBS[0] += 1
    return f"job_{_JOBS[0]}"
