"""CollapseWatch: a layer is reported once per streak of 5 steps on which one expert (any, it may change)
holds more than 90% of the layer's tokens; a step at or below the threshold ends the streak."""

import pytest

from folding.training.collapse import CollapseWatch

# 2 MoE layers (global layer numbers 1 and 3) of 4 experts, top-2: 100 tokens make 200 choices
BALANCED = [50, 50, 50, 50]
HOT0 = [100, 60, 20, 20]  # expert 0 chosen by all 100 tokens: share 1.0
HOT2 = [40, 5, 95, 60]  # expert 2: 95 of 100 tokens, share 0.95
EDGE = [90, 60, 30, 20]  # expert 0: exactly 90% of the tokens, not more


def _run(watch, rows):
    return [(step, w["layer"], w["experts"]) for step, row in enumerate(rows, 1) for w in watch.update(step, row)]


def test_fires_once_per_streak_naming_the_layer():
    watch = CollapseWatch(moe_layers=[1, 3], topk=2)
    rows = [[BALANCED, HOT0]] * 7 + [[BALANCED, EDGE]] + [[BALANCED, HOT2]] * 5
    # layer 3 collapses on steps 1-7 (warned at step 5 only), recovers at step 8 (exactly 90% is not
    # more than 90%), collapses again on steps 9-13 (a new streak: warned at step 13)
    assert _run(watch, rows) == [(5, 3, [0]), (13, 3, [2])]


def test_the_hot_expert_may_change_within_a_streak():
    watch = CollapseWatch(moe_layers=[1, 3], topk=2)
    rows = [[HOT0, BALANCED], [HOT2, BALANCED], [HOT0, BALANCED], [HOT2, BALANCED], [HOT2, BALANCED]]
    got = [w for step, row in enumerate(rows, 1) for w in watch.update(step, row)]
    assert [(w["layer"], w["experts"]) for w in got] == [(1, [0, 2])]
    assert got[0]["share"] == pytest.approx(0.95)
    msg = got[0]["message"]
    assert msg.startswith("router collapse in layer 1: one expert (experts 0, 2 in turn) got more than 90%")
    assert "steps 1-5" in msg and "95.0% at step 5" in msg


def test_four_steps_are_not_a_streak_and_layers_are_independent():
    watch = CollapseWatch(moe_layers=[1, 3], topk=2)
    rows = [[HOT0, HOT0]] * 4 + [[BALANCED, HOT0]] + [[HOT0, HOT0]] * 4
    assert _run(watch, rows) == [(5, 3, [0])]  # layer 1's two 4-step runs never warn


def test_bad_input():
    with pytest.raises(ValueError, match="one per MoE layer"):
        CollapseWatch(moe_layers=[0, 1], topk=2).update(1, [BALANCED])
    with pytest.raises(ValueError, match="topk >= 1"):
        CollapseWatch(moe_layers=[0], topk=0)
