"""Two lanes that take turns: the baton behind an overlap runtime's pairs.

A *pair* runs two callables as two *lanes* that hold one baton: exactly one lane runs at any time, and
a lane gives the baton away only at a hand-over (:meth:`Lanes.hand_over`, which
:class:`~folding.overlap.exchange.Exchange` calls when it is waited on, right after its collectives were
issued). Because the
hand-over points are fixed by the program, not by timing, every rank interleaves its lanes alike.

:class:`Lanes` holds the state (one per :class:`~folding.overlap.runtime.OverlapRuntime`; nothing is
module-level):

- :meth:`Lanes.run_pair` runs two callables as a pair (the first lane starts); nested use runs them one
  after the other.
- :meth:`Lanes.in_pair`, :meth:`Lanes.running_lane`: the state of the running pair.
- :meth:`Lanes.lane_thread`: the one persistent thread that runs every pair's second lane.
- :attr:`Lanes.stats`: the pairs run and the hand-overs between their lanes.

The baton is held by lanes, not threads: a lane may be served by another thread (the autograd engine
runs CUDA backward on its own device thread), so the state lives on the :class:`Lanes` object, which
every thread reaches through the runtime, guarded by one condition variable per pair. A pair is
confined to the process that runs it.

**Lanes and the autograd engine.** On CUDA the first lane's backward runs on the engine's one device
thread, which a hand-over parks; a graph task started by the second lane would queue behind it and
both would wait for ever. So the second lane never starts one: while a pair runs, :meth:`Lanes.run_pair`
puts a guard in front of the engine (every ``backward`` and ``autograd.grad`` passes it; the engine is
the process's own again when the pair ends) that raises :class:`LaneError` when the helper lane tries,
and the pair raises it even if the lane's code swallowed it. The second lane always runs on the same
persistent thread (:meth:`Lanes.lane_thread`, created on the first pair, stopped by
:meth:`Lanes.close`), so per-thread state (CUDA-graph
trees, thread-local caches) is built once, not per pair.

**Randomness across a hand-over.** The default generators (CPU, and the current CUDA device's) are
process-global, and non-reentrant activation recompute forks them (sets the forward's saved state,
restores its own on exit) around work that may hand over. Each lane therefore draws from its own copy:
a hand-over saves the leaving lane's generator state and restores the arriving lane's, both starting
from the state at the pair's start. At the end the pair keeps the state of the lane that advanced it;
when both did, their draws have no order that running them one after the other would give, and the
pair raises :class:`LaneError`. (The schedule pairs a backward, which draws nothing net: recompute
restores what it forked.)

The second lane runs in a copy of the context that called :meth:`Lanes.run_pair` (Python context
variables, so the current overlap runtime too) and in its grad mode, device and stream.

Usage::

    lanes = Lanes()
    first_result, second_result = lanes.run_pair(backward_of_m, forward_of_m_plus_1)
    lanes.hand_over()  # inside a lane, right after issuing collectives: the other lane runs meanwhile
    lanes.close()      # the helper thread ends
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import queue
import threading
import time
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch

# ------------------------------------------------------------------------------------ the baton


class LaneError(RuntimeError):
    """A pair broke a rule of its lanes: the second lane started an autograd graph task (it would
    deadlock behind the first lane's parked backward on CUDA), or both lanes drew random numbers."""


_RngState = Tuple[torch.Tensor, Optional[torch.Tensor]]


class _Pair:
    """The state of one running pair: whose turn it is, which lanes have finished, each lane's
    generator state while the other lane runs, and the thread serving the second lane while it runs
    its work (the engine guard refuses graph tasks from it)."""

    def __init__(self, rng: _RngState, cuda_index: Optional[int]) -> None:
        self.cond = threading.Condition()
        self.turn = 0
        self.done = [False, False]
        self.error: Optional[BaseException] = None
        self.cuda_index = cuda_index
        self.rng_start = rng
        self.rng: List[_RngState] = [rng, rng]
        self.helper_ident: Optional[int] = None
        self.handed_at = 0.0  # perf_counter() when the baton last changed hands


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


# ----------------------------------------------------------------- the helper lane and the engine


class _EngineGuard:
    """Stands in front of the autograd engine (``Variable._execution_engine``, which every
    ``backward`` and ``autograd.grad`` calls) while a pair runs: refuses a graph task started by the
    pair's second lane; everything else passes through unchanged."""

    def __init__(self, engine: Any, pair: _Pair) -> None:
        self.engine = engine
        self.pair = pair

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        """The engine's ``run_backward``, unless called from the helper lane (:class:`LaneError`)."""
        p = self.pair
        if p.helper_ident is not None and p.helper_ident == threading.get_ident():
            err = LaneError(
                "the second lane of an overlap pair started an autograd graph task (backward or "
                "autograd.grad): on CUDA it would wait for ever behind the first lane's backward, parked on "
                "the engine's device thread. Run it before the pair (a first-use probe: when the model is "
                "built) or in the first lane, or set parallel.overlap_moe_comm=false"
            )
            if p.error is None:
                p.error = err  # raised by run_pair even if the lane's code catches it
            raise err
        return self.engine.run_backward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


@contextlib.contextmanager
def _engine_guarded(pair: _Pair) -> Iterator[None]:
    """Put :class:`_EngineGuard` in front of the autograd engine for the block (a pair's lifetime); the
    engine found there is put back after it (a guard of another runtime's pair stays behind ours)."""
    from torch.autograd.variable import Variable

    engine = Variable._execution_engine
    Variable._execution_engine = _EngineGuard(engine, pair)
    try:
        yield
    finally:
        Variable._execution_engine = engine


class _LaneThread:
    """The one thread that runs the second lane of every pair of one :class:`Lanes`: it takes lane jobs
    from a queue until it is given ``None``."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.jobs: "queue.SimpleQueue[Optional[Callable[[], None]]]" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="folding-lane", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job()


# --------------------------------------------------------------------------------- the baton's counts


@dataclasses.dataclass
class Stats:
    """The pairs run and the hand-overs between their lanes since the last :meth:`reset`."""

    pairs: int = 0
    """Pairs run as two lanes (:meth:`Lanes.run_pair` outside another pair): proof that overlap was on."""
    hand_overs: int = 0
    """Hand-overs that switched lanes at an exchange (each one hides an exchange behind the other lane)."""
    switch_s: float = 0.0
    """Seconds between a lane giving the baton away and the other lane running again (the operating
    system waking a thread: on an oversubscribed host this is where a pair loses time)."""

    def reset(self) -> None:
        """Zero the counters."""
        self.pairs = 0
        self.hand_overs = 0
        self.switch_s = 0.0


# --------------------------------------------------------------------------------------- the lanes


class Lanes:
    """The baton of one overlap runtime: the running pair, the helper thread, its counters."""

    def __init__(self) -> None:
        self._pair: Optional[_Pair] = None
        self._server: Optional[_LaneThread] = None
        self._server_lock = threading.Lock()
        self.helper_context: Optional[Callable[[], Any]] = None
        """A factory of a context manager the second lane of every later pair enters around its work
        (``None``: nothing); for instruments (the order audit counts the helper lane's operators too).
        The engine sets none."""
        self.stats = Stats()
        """Counters of the baton (the trainer reports them per step)."""

    def in_pair(self) -> bool:
        """True while a pair runs and its other lane has not finished (a hand-over would switch lanes)."""
        p = self._pair
        return p is not None and not p.done[1 - p.turn]

    def running_lane(self) -> Optional[int]:
        """The lane of the running pair that holds the baton (0: the first, 1: the second), or None when
        no pair runs."""
        p = self._pair
        return None if p is None else p.turn

    def hand_over(self) -> None:
        """Give the baton to the other lane of the running pair and wait until it comes back (no-op
        outside a pair, or once the other lane has finished)."""
        p = self._pair
        if p is None:
            return
        with p.cond:
            me = p.turn
            if p.done[1 - me]:
                return
            self.stats.hand_overs += 1
            _leave(p, me)
            p.turn = 1 - me
            p.handed_at = time.perf_counter()
            p.cond.notify_all()
            p.cond.wait_for(lambda: p.turn == me)
            self.stats.switch_s += time.perf_counter() - p.handed_at
            _arrive(p, me)

    def _lane_server(self) -> _LaneThread:
        with self._server_lock:
            h = self._server
            if h is None or h.pid != os.getpid() or not h.thread.is_alive():
                self._server = _LaneThread()
            return self._server

    def lane_thread(self) -> threading.Thread:
        """The persistent thread that runs the second lane of every pair (started on the first call; a
        forked child starts its own)."""
        return self._lane_server().thread

    def close(self) -> None:
        """End the helper thread (a later pair starts a new one)."""
        with self._server_lock:
            h, self._server = self._server, None
        if h is not None and h.pid == os.getpid() and h.thread.is_alive():
            h.jobs.put(None)
            h.thread.join()

    def run_pair(self, first: Callable[[], Any], second: Callable[[], Any]) -> Tuple[Any, Any]:
        """Run ``first`` and ``second`` as the two lanes of a pair; return both results.

        ``first`` starts; each lane hands over at every exchange it waits on while the other is still
        running. ``second`` runs on the persistent :meth:`lane_thread`, in a copy of this thread's
        context (its context variables), grad mode and, on CUDA, its current device and stream; it must
        not start an autograd graph task (:class:`LaneError`). Each lane draws random numbers from its
        own copy of the generators (module docstring). An exception in either lane is raised here once
        both lanes have ended (a lane that raises ends; the other runs on to its end alone).
        """
        if self._pair is not None:  # already inside a pair: run one after the other
            return first(), second()
        grad = torch.is_grad_enabled()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        device = torch.cuda.current_device() if cuda else None
        stream = torch.cuda.current_stream() if cuda else None
        p = _Pair(_rng_get(device), device)
        results: List[Any] = [None, None]
        mode = self.helper_context
        context = contextvars.copy_context()

        def helper_work() -> Any:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.set_grad_enabled(grad))
                if cuda:
                    torch.cuda.set_device(device)
                    stack.enter_context(torch.cuda.stream(stream))
                if mode is not None:
                    stack.enter_context(mode())
                p.helper_ident = threading.get_ident()
                stack.callback(setattr, p, "helper_ident", None)
                return second()

        def lane(i: int, fn: Callable[[], Any]) -> None:
            with p.cond:
                p.cond.wait_for(lambda: p.turn == i)
                if i == 1:
                    self.stats.switch_s += time.perf_counter() - p.handed_at
                _arrive(p, i)
            try:
                results[i] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised by run_pair
                if p.error is None:
                    p.error = e
            finally:
                with p.cond:
                    _leave(p, i)
                    p.done[i] = True
                    p.turn = 1 - i
                    p.handed_at = time.perf_counter()
                    p.cond.notify_all()

        self._pair = p
        self.stats.pairs += 1
        p.handed_at = time.perf_counter()
        try:
            with _engine_guarded(p):
                self._lane_server().jobs.put(lambda: context.run(lane, 1, helper_work))
                lane(0, first)
                with p.cond:
                    p.cond.wait_for(lambda: p.done[1])
        finally:
            self._pair = None
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
