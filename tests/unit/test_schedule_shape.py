"""The pipeline schedules' shape against Megatron-Core's formulas and against the planner.

The warm-up depth of every rank is compared with Megatron-Core 0.16's ``get_pp_rank_microbatches``
(written out here, not imported): ``pp − rank − 1`` forwards under 1F1B; ``2(pp − rank − 1) + (vpp − 1)·pp``
under interleaved 1F1B, one more with ``overlap_moe_expert_parallel_comm``; capped by the step's forwards.
Megatron-Core has no overlapped 1F1B without virtual stages; there the engine's own rule is checked
(``2(pp − rank − 1) + 1``: neighbouring warm-ups differ by 2, ``folding.pipeline.order``). The planner's
:func:`in_flight_chunks` and :func:`paired_share` are compared with what the schedule that runs does:
its peak of forwards whose backward has not run, and its share of paired steps.
"""

import pytest

from folding.pipeline.comm_plan import Pair, rank_program
from folding.pipeline.order import schedule_order
from folding.planning.activations import in_flight_chunks
from folding.planning.moe_overlap import paired_share


def megatron_warmup(*, pp: int, rank: int, vpp: int, m: int, overlap: bool) -> int:
    """Megatron-Core 0.16's warm-up forwards of pipeline rank ``rank`` (``overlap``: with EP overlap)."""
    total = m * vpp
    if pp == 1:
        return 1 if overlap else 0  # combined_1f1b_schedule_for_no_pipelining starts with one forward
    if vpp == 1:
        n = 2 * (pp - rank - 1) + 1 if overlap else pp - rank - 1  # overlap: the engine's own rule
    else:
        n = 2 * (pp - rank - 1) + (vpp - 1) * pp + (1 if overlap else 0)
    return min(n, total)


def _shape(order):
    """``(leading forwards, pairs, peak of forwards without their backward)`` of a schedule order."""
    lead = next((i for i, s in enumerate(order) if s[0] != "F"), len(order))
    pairs = sum(s[0] == "FB" for s in order)
    live = peak = 0
    for s in order:
        if s[0] in ("F", "FB"):  # a pair runs its forward beside the backward: both alive at once
            live += 1
            peak = max(peak, live)
        if s[0] in ("B", "FB"):
            live -= 1
    return lead, pairs, peak


CASES = [
    (pp, vpp, m)
    for pp in range(1, 9)
    for vpp in range(1, 5)
    for m in sorted({pp, 2 * pp, 3 * pp, pp + 1, 1, 2 * pp + 3})
    if not (vpp > 1 and (pp == 1 or m % pp))  # interleaving needs PP > 1 and M a multiple of PP
]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_warmup_pairs_and_in_flight_chunks_follow_megatron_and_the_planner(overlap):
    checked = 0
    for pp, vpp, m in CASES:
        for r in range(pp):
            order = schedule_order(num_microbatches=m, pp_size=pp, pp_rank=r, vpp=vpp, overlap=overlap)
            lead, pairs, peak = _shape(order)
            want = megatron_warmup(pp=pp, rank=r, vpp=vpp, m=m, overlap=overlap)
            total = m * vpp
            # without overlap the steady state starts with a forward too (one forward, one backward)
            assert lead == (want if overlap else min(want + 1, total)), (pp, vpp, m, r, lead, want)
            assert pairs == (total - want if overlap else 0), (pp, vpp, m, r, pairs)
            if pp > 1 or overlap:  # the planner's count of chunk activations held at the peak
                planned = in_flight_chunks(pp=pp, vpp=vpp, stage=r, num_microbatches=m, overlap_moe_comm=overlap)
                assert peak == planned, (pp, vpp, m, r, peak, planned)
            if overlap:
                assert paired_share(pp=pp, vpp=vpp, stage=r, num_microbatches=m) == pytest.approx(pairs / total)
                if pp <= 4:  # the program the executor runs (its global plan simulates every rank: kept small)
                    program = rank_program(num_microbatches=m, pp=pp, vpp=vpp, pp_rank=r, overlap=True)
                    assert sum(isinstance(a, Pair) for a in program) == pairs
            checked += 1
    assert checked > 300
