"""CollapseWatch: a layer is reported once per streak of 5 steps on which its ``topk`` busiest experts
(any, they may change) take more than 90% of the layer's routed tokens; a step at or below the threshold
ends the streak. The definition is on the load, so it fires at top-1, top-2 and top-8 alike."""

import pytest

from folding.training.telemetry.collapse import CollapseWatch

# 2 MoE layers (global layer numbers 1 and 3) of 4 experts, top-2: 100 tokens make 200 routed copies
BALANCED = [50, 50, 50, 50]
HOT01 = [100, 95, 3, 2]  # experts 0 and 1 take 195 of 200: 97.5%
HOT23 = [2, 3, 95, 100]  # experts 3 and 2: 97.5%
EDGE = [100, 80, 10, 10]  # the busiest two take exactly 90%, not more
ONE_HOT = [100, 34, 33, 33]  # every token chose expert 0, the second choices spread: 67%, no collapse


def _run(watch, rows):
    return [(step, w["layer"], w["experts"]) for step, row in enumerate(rows, 1) for w in watch.update(step, row)]


def test_fires_once_per_streak_naming_the_layer():
    watch = CollapseWatch(moe_layers=[1, 3], topk=2)
    rows = [[BALANCED, HOT01]] * 7 + [[BALANCED, EDGE]] + [[BALANCED, HOT23]] * 5
    # layer 3 collapses on steps 1-7 (warned at step 5 only), recovers at step 8 (exactly 90% is not
    # more than 90%), collapses again on steps 9-13 (a new streak: warned at step 13)
    assert _run(watch, rows) == [(5, 3, [0, 1]), (13, 3, [2, 3])]


def test_the_busiest_experts_may_change_within_a_streak():
    watch = CollapseWatch(moe_layers=[1, 3], topk=2)
    rows = [[HOT01, BALANCED], [HOT23, BALANCED], [HOT01, BALANCED], [HOT23, BALANCED], [HOT23, BALANCED]]
    got = [w for step, row in enumerate(rows, 1) for w in watch.update(step, row)]
    assert [(w["layer"], w["experts"]) for w in got] == [(1, [0, 1, 2, 3])]
    assert got[0]["share"] == pytest.approx(0.975)
    msg = got[0]["message"]
    assert msg.startswith("router collapse in layer 1: its 2 busiest experts (0, 1, 2, 3 in turn) took more than 90%")
    assert "steps 1-5" in msg and "97.5% at step 5" in msg


def test_four_steps_are_not_a_streak_and_layers_are_independent():
    watch = CollapseWatch(moe_layers=[1, 3], topk=2)
    rows = [[HOT01, HOT01]] * 4 + [[BALANCED, HOT01]] + [[HOT01, HOT01]] * 4
    assert _run(watch, rows) == [(5, 3, [0, 1])]  # layer 1's two 4-step runs never warn


def test_top2_every_token_on_the_same_two_experts_fires_and_one_hot_expert_alone_does_not():
    # the layer: 8 experts, top-2, every token on experts 4 and 6 (load_imbalance 4.00, the ceiling)
    watch = CollapseWatch(moe_layers=[0, 1], topk=2)
    pair = [0, 0, 0, 0, 512, 0, 512, 0]
    rows = [[pair, ONE_HOT + [0] * 4]] * 5
    got = [w for step, row in enumerate(rows, 1) for w in watch.update(step, row)]
    assert [(w["layer"], w["experts"], w["share"]) for w in got] == [(0, [4, 6], 1.0)]
    assert got[0]["message"].startswith("router collapse in layer 0: its 2 busiest experts (experts 4, 6) took")


def test_top1_and_top8_fire_on_collapsed_loads_only():
    # top-1, 8 experts, 1000 tokens: expert 5 takes 950 (95%); a 60% favourite is no collapse
    top1 = CollapseWatch(moe_layers=[2], topk=1)
    hot, skewed = [10, 10, 10, 10, 0, 950, 10, 0], [60, 60, 60, 60, 0, 600, 80, 80]
    assert _run(top1, [[skewed]] * 6) == []
    got = [w for step in range(1, 6) for w in top1.update(step, [hot])]
    assert [(w["layer"], w["experts"]) for w in got] == [(2, [5])]
    assert got[0]["message"].startswith("router collapse in layer 2: expert 5 took more than 90% of the layer's")
    # top-8, 64 experts, 100 tokens (800 copies): experts 8..15 take 95 each (760, 95%), the rest 40 in all
    top8 = CollapseWatch(moe_layers=[0], topk=8)
    collapsed = [0] * 64
    for e in range(8, 16):
        collapsed[e] = 95
    for e in range(16, 56):
        collapsed[e] = 1
    spread = [13 if e % 2 else 12 for e in range(64)]  # 800 copies over 64 experts
    assert sum(collapsed) == sum(spread) == 800
    # a top-8 layer whose busiest eight take 80% (80 copies each) is not collapsed
    uneven = [80] * 8 + [3] * 48 + [2] * 8
    assert sum(uneven) == 800
    assert _run(top8, [[spread]] * 5 + [[uneven]] * 5) == []
    got = [w for step in range(1, 6) for w in top8.update(step, [collapsed])]
    assert [(w["layer"], w["experts"], w["share"]) for w in got] == [(0, list(range(8, 16)), 0.95)]


def test_bad_input():
    with pytest.raises(ValueError, match="one per MoE layer"):
        CollapseWatch(moe_layers=[0, 1], topk=2).update(1, [BALANCED])
    with pytest.raises(ValueError, match="topk >= 1"):
        CollapseWatch(moe_layers=[0], topk=0)
