"""The pipeline's communication plan: which messages each rank exchanges, and when (pure).

NCCL matches point-to-point operations between two ranks in issue order (tags are ignored), runs
them on one stream per communicator, and completes a send only when the peer's matching receive
runs; operations issued together in one ``batch_isend_irecv`` group progress together. A schedule
whose ranks issue their sends and receives in different orders therefore hangs on NCCL even though
it runs on gloo. This module removes the question by construction.

Every rank derives the same global plan from ``(num_microbatches, pp, vpp, forward_only)``: the
ranks' schedules (:func:`.order.schedule_order`) are played together in *ticks*; in a tick each
rank runs its next compute step if its input has arrived; after the tick, every message produced in
it is exchanged in one *round*. A rank's program is its compute steps with, after each tick in which
it sends or receives, one :class:`Exchange` holding all of its operations of that round, issued as one
group and waited for. Because both ends of every message place it in the same round, and every rank
meets its rounds in increasing order, round ``k`` completes once every rank has finished rounds
``< k`` (induction on ``k``): no deadlock, and the ``k``-th message between two ranks in one
direction is the same on both ends, so tags are not needed to match them.

Message keys: ``("F", v, m)`` is the activation entering virtual stage ``v`` for micro-batch ``m``
(sent by the rank of ``v − 1``, offset +1); ``("B", v, m)`` is the gradient of the output of virtual
stage ``v`` (sent by the rank of ``v + 1``, offset −1). Virtual stage ``v`` lives on pipeline rank
``v % pp`` as chunk ``v // pp``.

Usage::

    program = rank_program(num_microbatches=8, pp=4, vpp=2, pp_rank=1)
    for action in program:
        if isinstance(action, Compute): ...      # run ("F" | "B", chunk, microbatch)
        else: ...                                # one batch_isend_irecv of action.sends + action.recvs
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Optional, Tuple, Union

from .order import schedule_order

Key = Tuple[str, int, int]


@dataclass(frozen=True)
class Compute:
    """Run step ``kind`` (``"F"`` or ``"B"``) of chunk ``chunk`` on micro-batch ``microbatch``."""

    kind: str
    chunk: int
    microbatch: int


@dataclass(frozen=True)
class Pair:
    """Run ``forward`` and ``backward`` (two :class:`Compute` steps) merged, as the two lanes of
    :meth:`folding.overlap.runtime.OverlapRuntime.run_pair` (``parallel.overlap_moe_comm``)."""

    forward: Compute
    backward: Compute


@dataclass(frozen=True)
class Exchange:
    """One group of point-to-point operations, issued together and waited for.

    ``sends`` and ``recvs`` are ``(offset, key)`` pairs: ``offset`` +1 is the next pipeline rank,
    −1 the previous one. Sends are listed next-then-previous and receives previous-then-next, the
    order that keeps ``pp = 2`` (where both neighbours are one rank) unambiguous.
    """

    round: int
    sends: Tuple[Tuple[int, Key], ...]
    recvs: Tuple[Tuple[int, Key], ...]


Action = Union[Compute, Pair, Exchange]


def _needs_and_makes(kind: str, v: int, m: int, V: int) -> Tuple[Optional[Key], Optional[Tuple[int, Key]]]:
    """The message a step consumes and the ``(offset, message)`` it produces."""
    if kind == "F":
        need = ("F", v, m) if v > 0 else None
        make = (1, ("F", v + 1, m)) if v < V - 1 else None
    else:
        need = ("B", v, m) if v < V - 1 else None
        make = (-1, ("B", v - 1, m)) if v > 0 else None
    return need, make


def _order_key(offset: int, send: bool) -> int:
    # sends: next (+1) before previous (−1); receives: previous before next
    return -offset if send else offset


def _steps(entry: tuple) -> List[Compute]:
    """The compute steps of one schedule entry (one, or two for a pair)."""
    if entry[0] == "FB":
        return [Compute("F", entry[1], entry[2]), Compute("B", entry[3], entry[4])]
    return [Compute(*entry)]


@lru_cache(maxsize=64)
def global_plan(
    *, num_microbatches: int, pp: int, vpp: int = 1, forward_only: bool = False, overlap: bool = False
) -> Tuple[Tuple[Action, ...], ...]:
    """Every pipeline rank's program (index = pipeline rank), computed identically on all ranks.
    ``overlap``: the schedules with merged forward-backward pairs (:func:`.order.schedule_order`);
    a pair runs once both of its inputs have arrived, and its messages go in the round after it."""
    vpp = vpp or 1
    V = pp * vpp
    overlap = overlap and not forward_only
    orders = []
    for r in range(pp):
        order = schedule_order(num_microbatches=num_microbatches, pp_size=pp, pp_rank=r, vpp=vpp, overlap=overlap)
        orders.append([s for s in order if not (forward_only and s[0] == "B")])
    pos = [0] * pp
    inbox: List[set] = [set() for _ in range(pp)]
    programs: List[List[Action]] = [[] for _ in range(pp)]
    rnd = 0
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        sends: Dict[int, List[Tuple[int, Key]]] = {}
        recvs: Dict[int, List[Tuple[int, Key]]] = {}
        ran = False
        for r in range(pp):
            if pos[r] == len(orders[r]):
                continue
            steps = _steps(orders[r][pos[r]])
            io = [_needs_and_makes(c.kind, c.chunk * pp + r, c.microbatch, V) for c in steps]
            if any(need is not None and need not in inbox[r] for need, _ in io):
                continue
            for need, _ in io:
                inbox[r].discard(need)
            programs[r].append(steps[0] if len(steps) == 1 else Pair(*steps))
            pos[r] += 1
            ran = True
            for _, make in io:
                if make is not None:
                    offset, key = make
                    dst = (r + offset) % pp
                    sends.setdefault(r, []).append((offset, key))
                    recvs.setdefault(dst, []).append((-offset, key))
        if not ran:  # the schedules are deadlock-free as dataflow; this guards a future change
            raise RuntimeError(f"pipeline schedule stalls (pp={pp}, vpp={vpp}, M={num_microbatches})")
        for r, got in recvs.items():  # delivered after the tick: usable from the next one on
            inbox[r].update(key for _, key in got)
        for r in sorted(set(sends) | set(recvs)):
            s = tuple(sorted(sends.get(r, []), key=lambda o: _order_key(o[0], True)))
            q = tuple(sorted(recvs.get(r, []), key=lambda o: _order_key(o[0], False)))
            programs[r].append(Exchange(rnd, s, q))
        rnd += 1
    return tuple(tuple(p) for p in programs)


def rank_program(
    *, num_microbatches: int, pp: int, vpp: int, pp_rank: int, forward_only: bool = False, overlap: bool = False
) -> Tuple[Action, ...]:
    """This pipeline rank's program: its compute steps (and, with ``overlap``, pairs) in schedule
    order, with its exchanges."""
    return global_plan(
        num_microbatches=num_microbatches, pp=pp, vpp=vpp or 1, forward_only=forward_only, overlap=overlap
    )[pp_rank]
