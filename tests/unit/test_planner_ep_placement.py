"""The planner's line says where EP sits, so a folded and an unfolded layout of the same sizes read alike
only when their expert-parallel groups hold the same ranks (``folding.planning.planner.describe_plan``)."""

import itertools

from folding.model.presets import get_preset
from folding.parallel import LayoutError, ParallelLayout
from folding.planning.hardware import get_gpu
from folding.planning.planner import describe_plan, ep_in_dp, plan_layouts
from folding.planning.step_time import Cluster, Plan, TrainingShape


def _plan(**kw):
    base = dict(tp=1, cp=1, pp=1, vpp=1, ep=1, etp=1, dp=1, edp=1, distributed_optimizer=True, recompute="none")
    base.update(kw)
    return Plan(**base)


def test_the_line_that_two_listings_printed_alike():
    # Mixtral-8x22B on 128 H100: the same sizes were 49.3% folded and 42.6% unfolded, on the same line.
    sizes = dict(tp=1, cp=2, pp=8, vpp=7, ep=8, etp=1, dp=8, edp=2)
    folded, unfolded = _plan(**sizes), _plan(**sizes, folded=False)
    assert describe_plan(folded) == "TP1 CP2 DP8 PP8 VPP7 | ETP1 EP8 EDP2 EP over TP·CP·DP"
    assert describe_plan(unfolded) == "TP1 CP2 DP8 PP8 VPP7 | ETP1 EP8 EDP2 EP in DP"
    # EP1 has no placement; uneven stages are counted in the singular when there is one layer.
    assert describe_plan(_plan(pp=4, last_stage_layers=1)) == "TP1 CP1 DP1 PP4 (last stage 1 layer) | ETP1 EP1 EDP1"


def test_placement_matches_the_rank_groups():
    # Oracle: the folded layout's real groups. EP is "in DP" exactly when every EP group lies inside one
    # attention DP group.
    checked = {True: 0, False: 0}
    for tp, cp, ep, etp in itertools.product((1, 2, 4), (1, 2, 4), (1, 2, 4, 8), (1, 2, 4)):
        world = 32
        try:
            lay = ParallelLayout(world_size=world, tp=tp, cp=cp, ep=ep, etp=etp)
        except LayoutError:
            continue
        if ep == 1:
            continue
        groups = lay.groups()
        dp_groups = [set(g) for g in groups["attention"]["dp"]]
        inside = all(any(set(g) <= d for d in dp_groups) for g in groups["expert"]["ep"])
        plan = _plan(tp=tp, cp=cp, ep=ep, etp=etp, dp=lay.dp, edp=lay.edp)
        assert ep_in_dp(plan) == inside, (tp, cp, ep, etp)
        checked[inside] += 1
        # Without folding EP is carved out of DP (stride TP·CP): in DP by construction.
        assert ep_in_dp(_plan(tp=tp, cp=cp, ep=ep, etp=tp, dp=lay.dp, edp=lay.edp, folded=False))
    assert checked[True] > 5 and checked[False] > 5


def test_listings_print_the_same_line_only_for_the_same_layout():
    cl = Cluster(gpu=get_gpu("h100"), num_gpus=16)
    shape = TrainingShape(seq_length=64, global_batch_size=32)
    cfg = get_preset("mixtral_tiny")
    folded = [r.plan for r in plan_layouts(cfg, cluster=cl, shape=shape)]
    unfolded = [r.plan for r in plan_layouts(cfg, cluster=cl, shape=shape, folded=False)]
    sizes = lambda p: (p.tp, p.cp, p.pp, p.vpp, p.ep, p.etp)  # noqa: E731
    by_sizes = {sizes(p): p for p in folded}
    shared = [u for u in unfolded if sizes(u) in by_sizes]
    assert len(shared) == len(unfolded)  # every unfolded mapping is also a legal folded one
    alike = differ = 0
    for u in shared:
        f = by_sizes[sizes(u)]
        # the same sizes read alike exactly when the EP groups hold the same ranks: EP1, or CP1 with ETP = TP
        same_ranks = u.ep == 1 or u.cp == 1
        assert (describe_plan(f) == describe_plan(u)) == same_ranks, describe_plan(u)
        alike += same_ranks
        differ += not same_ranks
    assert alike and differ
