"""Long-lived multi-process gloo ranks that run functions on demand (tests, tools, benchmarks).

Starting a rank costs ~1-2 s of CPU (import torch, init the process group), so a pool starts its N
ranks once and reuses them for every function it runs. Each call sends a module-level function and
its arguments to every rank, waits for all results, and either returns them in rank order or raises
:class:`RankFailure` with the failing rank's traceback. A call that fails on any rank, or does not
finish within its timeout, shuts the pool down (a half-done collective or group creation leaves the
ranks disagreeing, and a hung collective cannot be recovered); the next call on a dead pool raises
too, so callers re-create it (``tests/conftest.py`` does this).

Usage::

    def work(scale):                      # module level, importable by the ranks
        t = torch.ones(1) * dist.get_rank() * scale
        dist.all_reduce(t)
        return t.item()

    with RankPool(4) as pool:
        pool.run(work, 2.0)               # [12.0, 12.0, 12.0, 12.0]
"""

from __future__ import annotations

import datetime
import gc
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, List, Optional

from folding.parallel.groups import release_shared_node_split_groups


class RankFailure(RuntimeError):
    """A function raised on one or more ranks; the message holds the first failing rank's traceback."""


def _die_with_parent() -> None:
    """Linux: have the kernel kill this rank when the process that started it dies, even in the middle
    of a task (a rank busy in a long run would otherwise only notice between tasks)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the between-tasks check below still applies
        pass


def _end_task_groups() -> None:
    """Destroy the process groups a task left alive, once every rank has finished it (a barrier on the
    default group first, so no rank closes a group another still uses). torch.distributed keeps every
    group it created until it is destroyed, whoever still refers to it, and each live gloo group keeps
    threads of its own: left alive, they pile up in a long-lived rank (hundreds of threads after a few
    dozen tests) and slow every later task."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    default = c10d._get_default_group()
    if not [pg for pg in list(c10d._world.pg_map) if pg is not default]:
        release_shared_node_split_groups()  # the task destroyed the shared node and rail groups: forget them
        return
    dist.barrier()
    release_shared_node_split_groups()  # the node and rail groups a task's dispatchers shared: forgotten too
    for pg in [pg for pg in list(c10d._world.pg_map) if pg is not default]:
        dist.destroy_process_group(pg)


def _worker(rank: int, world: int, init_file: str, tasks, results, coll_timeout_s: float) -> None:
    _die_with_parent()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=coll_timeout_s),
    )
    results.put((-1, rank, True, b""))
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the caller was killed: do not linger as an orphan
                break
            continue
        if task is None:
            break
        tid, fn, args, kwargs = task
        try:
            value = fn(*args, **kwargs)
            payload = pickle.dumps(value)
            _end_task_groups()
            results.put((tid, rank, True, payload))
        except BaseException:  # report everything, including assertion errors, to the caller
            results.put((tid, rank, False, traceback.format_exc()))
        # free what the call left in reference cycles now (models hold process groups, and every
        # live gloo group keeps three threads polling), not whenever the collector next runs; then
        # exempt what survived (modules, torch's and the rank's long-lived state: about 300k objects)
        # from every later collection, which would otherwise walk them all again: 0.15 s of CPU per
        # rank per call, as much as a short training run of 8 ranks on 2 cores
        task = fn = args = kwargs = value = payload = None
        gc.collect()
        gc.freeze()
    dist.destroy_process_group()
    gc.collect()  # the group objects go (their gloo threads joined) before the interpreter finalizes


class RankPool:
    """``world_size`` gloo ranks in spawned processes, reused across calls.

    Args:
        world_size: number of ranks.
        start_timeout_s: time allowed for all ranks to start and join the process group.
        collective_timeout_s: gloo's timeout for a collective that never completes.
    """

    def __init__(self, world_size: int, *, start_timeout_s: float = 180.0, collective_timeout_s: float = 300.0):
        self.world_size = world_size
        self._ctx = mp.get_context("spawn")
        fd, self._init_file = tempfile.mkstemp(prefix="folding_pool_")
        os.close(fd)
        os.unlink(self._init_file)
        self._tasks = [self._ctx.Queue() for _ in range(world_size)]
        self._results = self._ctx.Queue()
        self._procs = [
            self._ctx.Process(
                target=_worker,
                daemon=True,
                args=(r, world_size, self._init_file, self._tasks[r], self._results, collective_timeout_s),
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._ids = itertools.count()
        self.alive = True
        self._collect(-1, start_timeout_s, what="start-up")

    # ------------------------------------------------------------------------------------------
    def _collect(self, tid: int, timeout_s: float, what: str) -> List[Any]:
        deadline = time.monotonic() + timeout_s
        got: dict = {}
        failures: dict = {}
        grace_deadline: Optional[float] = None
        while len(got) + len(failures) < self.world_size:
            limit = grace_deadline if grace_deadline is not None else deadline
            remaining = limit - time.monotonic()
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got and r not in failures]
            if remaining <= 0 or dead:
                break
            try:
                rid, rank, ok, payload = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if rid != tid:
                continue  # a late answer from an earlier, failed call
            if ok:
                got[rank] = payload
            else:
                failures[rank] = payload
                if grace_deadline is None:  # give the other ranks a moment to report too
                    grace_deadline = min(deadline, time.monotonic() + 10.0)
        missing = [r for r in range(self.world_size) if r not in got and r not in failures]
        if failures:
            # a rank that raised may have left collectives or group creation half done, so the
            # ranks no longer agree on the world's state: the next call could hang; start afresh
            self.shutdown()
            first = min(failures)
            raise RankFailure(
                f"{what} failed on rank(s) {sorted(failures)} of {self.world_size}"
                f"{'; ranks ' + str(missing) + ' did not answer' if missing else ''}."
                f"\n--- traceback of rank {first} ---\n{failures[first]}"
            )
        if missing:
            dead = [r for r in missing if not self._procs[r].is_alive()]
            self.shutdown()
            if dead:
                raise RankFailure(f"{what}: rank(s) {dead} of {self.world_size} died")
            raise TimeoutError(
                f"{what} did not finish within {timeout_s:.0f} s on rank(s) {missing} "
                f"of {self.world_size}; the pool was shut down"
            )
        return [got[r] for r in range(self.world_size)]

    def run(self, fn: Callable, *args, timeout_s: float = 300.0, **kwargs) -> List[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``fn`` must be a module-level function (it is pickled by reference). Raises
        :class:`RankFailure` if any rank raised, ``TimeoutError`` after ``timeout_s``.
        """
        if not self.alive:
            raise RuntimeError("this RankPool was shut down after an earlier failure; create a new one")
        tid = next(self._ids)
        for q in self._tasks:
            q.put((tid, fn, args, kwargs))
        payloads = self._collect(tid, timeout_s, what=f"{getattr(fn, '__qualname__', fn)}")
        return [pickle.loads(p) for p in payloads]

    def shutdown(self) -> None:
        """Stop every rank (politely, then by force)."""
        if not self.alive:
            return
        self.alive = False
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:
                pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(5.0)
        try:
            os.unlink(self._init_file)
        except OSError:
            pass

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
