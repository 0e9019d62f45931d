"""The order audit and the wait statistics of the token exchanges (tests and benchmarks only).

Both subscribe to the exchanges (:class:`folding.overlap.exchange.Exchange`) of an overlap runtime
(:meth:`folding.overlap.runtime.OverlapRuntime.observe`); the engine imports nothing from here.

- :func:`audit` records, for each exchange, the compute operations issued between its start and its
  wait (the order audit of the overlap tests).
- :func:`wait_stats` accumulates the time spent blocked in exchange waits (the benchmark's exposed
  time). The pairs run and the hand-overs between their lanes are the baton's own counters
  (:attr:`folding.overlap.runtime.OverlapRuntime.stats`, reported by the trainer per step).

Usage::

    runtime = OverlapRuntime()
    with audit(runtime) as log:
        run_schedule(runtime)           # log: one {"what", "steady", "paired", "ops"} per exchange
    with wait_stats(runtime) as waits:
        run_schedule(runtime)
    waits.blocked_s
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, Iterator, List

from folding.overlap import exchange as overlap
from folding.overlap.runtime import OverlapRuntime

# ------------------------------------------------------------------------------------- the audit

_op_count = [0]


def _counting_mode():
    """A dispatch mode that counts the compute operations (every aten op but views and metadata)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func._schema.is_mutable and "view" not in func.__name__:
                _op_count[0] += 1
            return func(*args, **(kwargs or {}))

    return _Count()


class _Audit(overlap.ExchangeObserver):
    """Appends one entry per overlap point waited on (count reads that hand nothing over are left out)."""

    def __init__(self, log: List[Dict[str, Any]]):
        self.log = log
        self.ops0 = _op_count[0]

    def issued(self, ex: overlap.Exchange) -> None:
        ex.marks["ops"] = _op_count[0]

    def finished(self, ex: overlap.Exchange, waited_s: float) -> None:
        if ex.overlap_point:
            ops = _op_count[0] - ex.marks.get("ops", self.ops0)
            self.log.append({"what": ex.what, "steady": ex.steady, "paired": ex.paired, "ops": ops})


@contextlib.contextmanager
def audit(runtime: OverlapRuntime) -> Iterator[List[Dict[str, Any]]]:
    """Record every exchange of ``runtime`` inside the block: a list of ``{"what", "steady", "paired", "ops"}``,
    where ``ops`` counts the compute operations this process issued between the exchange's start and
    its wait (in either lane), ``steady`` says whether it started inside
    :meth:`folding.overlap.runtime.OverlapRuntime.steady_state` and ``paired`` whether a pair was running with its
    other lane alive when it was waited on."""
    log: List[Dict[str, Any]] = []
    runtime.set_helper_context(_counting_mode)  # the helper lane of a pair counts too
    try:
        with runtime.observe(_Audit(log)), _counting_mode():
            yield log
    finally:
        runtime.set_helper_context(None)


# ----------------------------------------------------------------------------- the wait statistics


@dataclasses.dataclass(eq=False)  # installed observers are told apart by identity
class WaitStats(overlap.ExchangeObserver):
    """Time blocked in exchange waits since the last :meth:`reset` (seconds)."""

    blocked_s: float = 0.0
    """Wall time spent waiting for exchanges to complete (what the exchanges cost the critical path)."""
    blocked_by: Dict[str, float] = dataclasses.field(default_factory=dict)
    """``blocked_s`` split by what was waited on (each exchange's ``what``: ``"ep counts"`` for the
    dispatchers' count all-gathers read on the host)."""

    def reset(self) -> None:
        """Zero the counters."""
        self.blocked_s = 0.0
        self.blocked_by = {}

    def finished(self, ex: overlap.Exchange, waited_s: float) -> None:
        """Add one exchange's time blocked (a link model's modelled completion included)."""
        self.blocked_s += waited_s
        self.blocked_by[ex.what] = self.blocked_by.get(ex.what, 0.0) + waited_s


@contextlib.contextmanager
def wait_stats(runtime: OverlapRuntime) -> Iterator[WaitStats]:
    """Accumulate, inside the block, the time blocked in every exchange wait of ``runtime``; yields the
    :class:`WaitStats`."""
    with runtime.observe(WaitStats()) as waits:
        yield waits
