"""What the hot-expert replica re-plans did, as the trainer reports it (``moe.expert_replicas``).

Every re-plan (:meth:`folding.moe.replicas.table.ReplicaSchedule.observe`) yields one record per MoE layer;
:func:`replan_message` turns it into the console / ``train.log`` line, and the trainer writes the
record itself to ``metrics.jsonl`` as ``{"kind": "replan", "step", "message", "layer", "steps",
"before", "after"}``. ``before`` and ``after`` describe the interval's measured loads under the old and
the new slot table: ``copies`` (``{"expert": [EP ranks holding a replica]}``) and ``max_over_mean`` (the
busiest EP rank's tokens over the mean, each copy of an expert taking an equal share). Every ``train``
record also carries ``replicas``: per layer the table in use that step and the same two ratios for
the step's own loads (with the table, and without replicas).

Usage::

    for rec in schedule.observe(loads):
        sink.event("replan", step, replan_message(step, rec), **rec)
"""

from __future__ import annotations

from typing import Any, Dict


def _copies(copies: Dict[str, Any]) -> str:
    if not copies:
        return "no replica"
    return "; ".join(
        f"expert {e} on EP rank{'s' if len(r) > 1 else ''} {', '.join(str(x) for x in r)}" for e, r in copies.items()
    )


def replan_message(step: int, rec: Dict[str, Any]) -> str:
    """One line: the layer, the new copies (expert → EP ranks) and max/mean before → after."""
    before, after = rec["before"], rec["after"]
    return (
        f"replicas re-planned at step {step}, layer {rec['layer']}: {_copies(after['copies'])}; EP-rank max/mean "
        f"load {before['max_over_mean']:.2f} -> {after['max_over_mean']:.2f} over the last {rec['steps']} "
        f"step{'s' if rec['steps'] > 1 else ''} (without replicas {after['max_over_mean_without']:.2f})"
    )
