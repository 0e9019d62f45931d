"""A simulator of NCCL's point-to-point rules, to find pipeline deadlocks on a CPU.

Model (stricter than NCCL where it differs, so a sequence it accepts is safe on NCCL):

- each rank issues *groups* of operations in program order onto **one FIFO stream** (one
  communicator for the whole pipeline group; NCCL runs the p2p of one pair on one stream, and
  Megatron-Core's pipeline uses one communicator for all of it);
- a group becomes active when it reaches the head of its rank's stream; its operations progress
  together (one ``ncclGroupStart/End``), and the group completes when all of them have;
- a send and a receive complete together, when both are in active groups (no eager buffering);
- the ``k``-th send from ``a`` to ``b`` matches the ``k``-th receive at ``b`` from ``a``
  (tags are ignored); if the two carry different message keys the data would be wrong, which
  :func:`simulate` reports as a mismatch;
- a group issued with ``wait=True`` blocks its rank's host program until it completes; ``wait=False``
  lets the program go on (an async ``isend`` kept pending); ``WaitAll`` blocks until every group the
  rank issued has completed.

Usage::

    programs = {0: [Group([Op("send", 1, key)], wait=False), Group([Op("recv", 1, key2)])], 1: [...]}
    result = simulate(programs)       # result.deadlock, result.mismatch, result.detail
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional, Sequence, Union


@dataclass(frozen=True)
class Op:
    """One point-to-point operation: ``kind`` is ``"send"`` or ``"recv"``, ``peer`` a rank,
    ``key`` what the message is (used only to check that matched operations agree)."""

    kind: str
    peer: int
    key: Hashable = None


@dataclass
class Group:
    """Operations issued together; ``wait`` blocks the issuing program until they complete."""

    ops: Sequence[Op]
    wait: bool = True


@dataclass(frozen=True)
class WaitAll:
    """Block the program until every group this rank issued has completed."""


Item = Union[Group, WaitAll]


@dataclass
class SimResult:
    """Outcome: ``deadlock`` (some rank never finishes), ``mismatch`` (matched ops disagree)."""

    deadlock: bool = False
    mismatch: bool = False
    detail: str = ""
    rounds: int = 0


@dataclass
class _Issued:
    rank: int
    ops: List[Op]
    index: List[int]  # per-pair sequence number of each op
    done: List[bool] = field(default_factory=list)


def simulate(programs: Dict[int, Sequence[Item]], *, max_steps: int = 1_000_000) -> SimResult:
    """Run every rank's program under the rules of the module docstring."""
    ranks = sorted(programs)
    pc = {r: 0 for r in ranks}
    stream: Dict[int, deque] = {r: deque() for r in ranks}
    blocked: Dict[int, Optional[object]] = {r: None for r in ranks}
    counters: Dict[tuple, int] = {}
    # (sender, receiver, n) -> issued group and op position, for each side
    sends: Dict[tuple, tuple] = {}
    recvs: Dict[tuple, tuple] = {}
    steps = 0
    while steps < max_steps:
        steps += 1
        progress = False
        for r in ranks:  # host programs issue until they block
            while blocked[r] is None and pc[r] < len(programs[r]):
                item = programs[r][pc[r]]
                pc[r] += 1
                progress = True
                if isinstance(item, WaitAll):
                    if stream[r]:
                        blocked[r] = "all"
                    continue
                g = _Issued(r, list(item.ops), [], [False] * len(item.ops))
                for i, op in enumerate(g.ops):
                    pair = (r, op.peer) if op.kind == "send" else (op.peer, r)
                    ck = (op.kind,) + pair
                    n = counters.get(ck, 0)
                    counters[ck] = n + 1
                    g.index.append(n)
                    (sends if op.kind == "send" else recvs)[pair + (n,)] = (g, i)
                stream[r].append(g)
                if item.wait:
                    blocked[r] = g
        heads = {r: stream[r][0] for r in ranks if stream[r]}
        for r, g in heads.items():  # match operations of active groups
            for i, op in enumerate(g.ops):
                if g.done[i] or op.kind != "send":
                    continue
                other = recvs.get((r, op.peer, g.index[i]))
                if other is None or heads.get(op.peer) is not other[0]:
                    continue
                og, oi = other
                if og.ops[oi].key != op.key:
                    return SimResult(
                        mismatch=True,
                        rounds=steps,
                        detail=(f"send {op.key} from rank {r} matched receive {og.ops[oi].key} on rank {op.peer}"),
                    )
                g.done[i] = og.done[oi] = True
                progress = True
        for r in ranks:  # retire completed heads, release blocked programs
            while stream[r] and all(stream[r][0].done):
                g = stream[r].popleft()
                progress = True
                if blocked[r] is g or (blocked[r] == "all" and not stream[r]):
                    blocked[r] = None
        if not progress:
            break
    stuck = [r for r in ranks if pc[r] < len(programs[r]) or stream[r] or blocked[r] is not None]
    if not stuck:
        return SimResult(rounds=steps)
    lines = []
    for r in stuck:
        head = stream[r][0] if stream[r] else None
        pending = (
            [] if head is None else [f"{op.kind}->{op.peer}:{op.key}" for op, d in zip(head.ops, head.done) if not d]
        )
        lines.append(f"rank {r}: item {pc[r]}/{len(programs[r])}, head group waits on {pending}")
    return SimResult(deadlock=True, rounds=steps, detail="; ".join(lines))
