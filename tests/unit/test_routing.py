"""Pure routing functions against hand-worked cases (expected values explained inline) and against
an independent per-token loop oracle of Megatron-Core's semantics on random inputs."""

import math

import pytest
import torch

from folding.moe.routing import functions as R

LN = math.log


def _close(a, b, tol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), rtol=tol, atol=tol
    )


# ------------------------------------------------------------------------------ score functions
def test_softmax_after_topk():
    # top-2 of [1, 3, 2, 0] are experts 1 (3) and 2 (2); softmax([3, 2]) = [e, 1] / (e + 1)
    probs, rmap = R.topk_routing(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), topk=2)
    e = math.e
    _close(probs, [[0, e / (e + 1), 1 / (e + 1), 0]])
    assert rmap.tolist() == [[False, True, True, False]]


def test_softmax_before_topk_is_not_renormalized():
    # softmax(log[1, 2, 3, 4]) = [.1, .2, .3, .4]; top-2 keeps .4 and .3 as they are (sum .7)
    logits = torch.tensor([[LN(1), LN(2), LN(3), LN(4)]])
    probs, rmap = R.topk_routing(logits, topk=2, pre_softmax=True)
    _close(probs, [[0, 0, 0.3, 0.4]])
    assert rmap.tolist() == [[False, False, True, True]]


def test_sigmoid_renormalized_for_k_above_one():
    # sigmoid([0, ln3, -ln3, ln9]) = [.5, .75, .25, .9]; top-2 = .9, .75 -> /1.65
    logits = torch.tensor([[0.0, LN(3), -LN(3), LN(9)]])
    probs, _ = R.topk_routing(logits, topk=2, score_function="sigmoid")
    _close(probs, [[0, 0.75 / 1.65, 0, 0.9 / 1.65]])
    # k = 1: the raw sigmoid score, not renormalized
    probs1, _ = R.topk_routing(logits, topk=1, score_function="sigmoid")
    _close(probs1, [[0, 0, 0, 0.9]])


def test_scaling_factor_multiplies_final_probs():
    logits = torch.tensor([[0.0, LN(3), -LN(3), LN(9)]])
    probs, _ = R.topk_routing(logits, topk=2, score_function="sigmoid", scaling_factor=2.5)
    _close(probs, [[0, 2.5 * 0.75 / 1.65, 0, 2.5 * 0.9 / 1.65]])


def test_group_limited_routing_masks_weak_groups():
    # E=6 in 3 groups {0,1} {2,3} {4,5}; k=2, group_topk=1 -> a group scores the sum of its top 2.
    # group sums: 5+0=5, 3+3=6, 1+1=2 -> only group 1 survives, so expert 0 (the largest logit)
    # is excluded and the choice is experts 2 and 3 with softmax([3, 3]) = [.5, .5].
    logits = torch.tensor([[5.0, 0.0, 3.0, 3.0, 1.0, 1.0]])
    probs, rmap = R.topk_routing(logits, topk=2, num_groups=3, group_topk=1)
    _close(probs, [[0, 0, 0.5, 0.5, 0, 0]])
    # without groups expert 0 is chosen
    assert R.topk_routing(logits, topk=2)[1][0, 0]


def test_group_score_topk_overrides_megatron_rule():
    # E=6 in 3 groups {0,1} {2,3} {4,5}; k=2, group_topk=2. Megatron's rule scores a group by its top
    # k//group_topk = 1: 5, 3, 4.5 -> groups 0 and 2 -> experts 0 and 4 (5, 4.5).
    # DeepSeek-V3's top-2 sum: 5+0=5, 3+2.9=5.9, 4.5+0=4.5 -> groups 0 and 1 -> experts 0 and 2 (5, 3).
    logits = torch.tensor([[5.0, 0.0, 3.0, 2.9, 4.5, 0.0]])
    _, megatron = R.topk_routing(logits, topk=2, num_groups=3, group_topk=2)
    assert megatron[0].nonzero().flatten().tolist() == [0, 4]
    _, deepseek = R.topk_routing(logits, topk=2, num_groups=3, group_topk=2, group_score_topk=2)
    assert deepseek[0].nonzero().flatten().tolist() == [0, 2]
    # group_topk may exceed topk when groups are scored explicitly (HF allows it); not beyond a group's size
    assert R.topk_routing(logits, topk=1, num_groups=3, group_topk=2, group_score_topk=2, score_function="sigmoid")
    with pytest.raises(ValueError, match="top 3"):
        R.topk_routing(logits, topk=2, num_groups=3, group_topk=2, group_score_topk=3)


def test_expert_bias_changes_choice_not_probs():
    # bias 2.5 on expert 3 lifts it to 2.5 > 2 (expert 2): choice {1, 3}; probs use the raw logits:
    # softmax([3, 0]) = [e^3, 1] / (e^3 + 1)
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    probs, rmap = R.topk_routing(logits, topk=2, expert_bias_E=torch.tensor([0, 0, 0, 2.5]))
    e3 = math.exp(3)
    _close(probs, [[0, e3 / (e3 + 1), 0, 1 / (e3 + 1)]])
    # sigmoid: bias on expert 0 makes it chosen with its raw score .5; .5 and .9 renormalized
    logits = torch.tensor([[0.0, LN(3), -LN(3), LN(9)]])
    probs, _ = R.topk_routing(logits, topk=2, score_function="sigmoid", expert_bias_E=torch.tensor([1.0, 0, 0, 0]))
    _close(probs, [[0.5 / 1.4, 0, 0, 0.9 / 1.4]])


def _oracle(logits, topk, score_function, pre_softmax, num_groups, group_topk, scaling, bias):
    """Per-token loop, written from the textual definition (docs/routing.md)."""
    T, E = logits.shape
    probs = torch.zeros(T, E, dtype=torch.float64)
    for t in range(T):
        x = logits[t].double()
        if score_function == "sigmoid":
            s = torch.sigmoid(x)
        elif pre_softmax:
            s = torch.softmax(x, 0)
        else:
            s = x.clone()
        sel = s + (0 if bias is None else bias.double())
        allowed = list(range(E))
        if num_groups:
            per = E // num_groups
            gscore = [
                sorted(sel[g * per : (g + 1) * per].tolist(), reverse=True)[: topk // group_topk]
                for g in range(num_groups)
            ]
            best = sorted(range(num_groups), key=lambda g: -sum(gscore[g]))[:group_topk]
            allowed = [e for e in allowed if e // per in best]
        chosen = sorted(allowed, key=lambda e: -sel[e].item())[:topk]
        v = s[chosen]
        if score_function == "softmax" and not pre_softmax:
            v = torch.softmax(v, 0)
        if score_function == "sigmoid" and topk > 1:
            v = v / v.sum()
        probs[t, chosen] = v * (scaling or 1.0)
    return probs


@pytest.mark.parametrize(
    "case",
    [
        dict(topk=2, score_function="softmax", pre_softmax=False),
        dict(topk=3, score_function="softmax", pre_softmax=True),
        dict(topk=2, score_function="sigmoid", pre_softmax=False, scaling=2.0),
        dict(topk=4, score_function="softmax", pre_softmax=False, num_groups=4, group_topk=2),
        dict(topk=4, score_function="sigmoid", pre_softmax=False, num_groups=2, group_topk=1, bias=True),
        dict(topk=1, score_function="softmax", pre_softmax=True, bias=True),
    ],
)
def test_topk_routing_matches_loop_oracle(case):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(13, 8, generator=g, dtype=torch.float64)
    bias = torch.randn(8, generator=g, dtype=torch.float64) * 0.5 if case.get("bias") else None
    kw = dict(
        topk=case["topk"],
        score_function=case["score_function"],
        pre_softmax=case["pre_softmax"],
        num_groups=case.get("num_groups"),
        group_topk=case.get("group_topk"),
    )
    probs, rmap = R.topk_routing(logits, scaling_factor=case.get("scaling"), expert_bias_E=bias, **kw)
    ref = _oracle(
        logits,
        case["topk"],
        case["score_function"],
        case["pre_softmax"],
        case.get("num_groups"),
        case.get("group_topk"),
        case.get("scaling"),
        bias,
    )
    _close(probs, ref, 1e-12)
    assert torch.equal(rmap, ref != 0)
    assert (rmap.sum(1) == case["topk"]).all()


def test_topk_routing_bad_input():
    with pytest.raises(ValueError, match="topk"):
        R.topk_routing(torch.zeros(2, 4), topk=5)
    with pytest.raises(ValueError, match="num_groups"):
        R.topk_routing(torch.zeros(2, 6), topk=2, num_groups=4, group_topk=1)
    with pytest.raises(ValueError, match="score_function"):
        R.topk_routing(torch.zeros(2, 4), topk=2, score_function="relu")


def test_balanced_routing_round_robin():
    # T=3, E=4, k=2: token 0 -> {0,1}, token 1 -> {2,3}, token 2 -> {0,1}; probs from the real logits
    logits = torch.tensor([[0.0, LN(3), 9, 9], [9, 9, 0, 0], [LN(3), 0, 9, 9]])
    probs, rmap = R.balanced_routing(logits, topk=2)
    assert rmap.int().tolist() == [[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 0, 0]]
    _close(probs, [[0.25, 0.75, 0, 0], [0, 0, 0.5, 0.5], [0.75, 0.25, 0, 0]])


# ------------------------------------------------------------------------------------- capacity
def _capacity_case():
    # T=4, E=2, k=1 -> capacity = ceil(4·1/2 · 1.0) = 2.
    # expert 0 is routed tokens 0 (.9), 1 (.6), 2 (.8): one too many; expert 1 only token 3 (.7).
    probs = torch.tensor([[0.9, 0], [0.6, 0], [0.8, 0], [0, 0.7]])
    return probs, probs > 0


def test_capacity_probs_policy_keeps_highest():
    probs, rmap = R.apply_capacity(*_capacity_case(), topk=1, capacity_factor=1.0, drop_policy="probs")
    # expert 0 keeps tokens 0 and 2 (.9, .8) and drops token 1 (.6)
    assert rmap.int().tolist() == [[1, 0], [0, 0], [1, 0], [0, 1]]
    _close(probs, [[0.9, 0], [0, 0], [0.8, 0], [0, 0.7]])


def test_capacity_position_policy_keeps_earliest():
    probs, rmap = R.apply_capacity(*_capacity_case(), topk=1, capacity_factor=1.0, drop_policy="position")
    # expert 0 keeps tokens 0 and 1 (earliest) and drops token 2
    assert rmap.int().tolist() == [[1, 0], [1, 0], [0, 0], [0, 1]]


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_pad_to_capacity_gives_exactly_capacity_rows(policy):
    probs, rmap = R.apply_capacity(
        *_capacity_case(), topk=1, capacity_factor=1.0, drop_policy=policy, pad_to_capacity=True
    )
    assert rmap.sum(0).tolist() == [2, 2]
    # expert 1: its routed token 3 plus the earliest filler, token 0, with probability 0
    assert rmap[:, 1].int().tolist() == [1, 0, 0, 1]
    _close(probs[:, 1], [0, 0, 0, 0.7])


def test_pad_when_capacity_exceeds_tokens_routes_everything():
    # capacity = ceil(4·1/2 · 3) = 6 > T=4: nothing dropped; padded, every token goes to every expert
    probs0, rmap0 = _capacity_case()
    probs, rmap = R.apply_capacity(probs0, rmap0, topk=1, capacity_factor=3.0)
    assert torch.equal(rmap, rmap0) and torch.equal(probs, probs0)
    probs, rmap = R.apply_capacity(probs0, rmap0, topk=1, capacity_factor=3.0, pad_to_capacity=True)
    assert rmap.all() and torch.equal(probs, probs0)


@pytest.mark.parametrize("seed", range(6))
def test_capacity_kept_rows_property(seed):
    g = torch.Generator().manual_seed(seed)
    T, E, k = int(torch.randint(3, 40, (1,), generator=g)), 8, 2
    cf = float(torch.empty(1).uniform_(0.3, 2.0, generator=g))
    probs, rmap = R.topk_routing(torch.randn(T, E, generator=g), topk=k)
    cap = R.expert_capacity(T, topk=k, num_experts=E, capacity_factor=cf)
    for policy in ("probs", "position"):
        p2, m2 = R.apply_capacity(probs, rmap, topk=k, capacity_factor=cf, drop_policy=policy)
        assert torch.equal(m2.sum(0), rmap.sum(0).clamp(max=cap))
        assert not (m2 & ~rmap).any()  # never adds a pair
        assert torch.equal(p2, probs * m2)
        p3, m3 = R.apply_capacity(probs, rmap, topk=k, capacity_factor=cf, drop_policy=policy, pad_to_capacity=True)
        assert (m3.sum(0) == min(cap, T)).all()
        assert torch.equal(m3 & rmap, m2)  # same routed pairs kept as without padding
        assert torch.equal(p3, p2)
    if cap < T:  # probs policy keeps the highest
        p2, m2 = R.apply_capacity(probs, rmap, topk=k, capacity_factor=cf)
        for e in range(E):
            kept, dropped = probs[m2[:, e], e], probs[rmap[:, e] & ~m2[:, e], e]
            if len(dropped):
                assert kept.min() >= dropped.max()


def test_capacity_bad_input():
    with pytest.raises(ValueError, match="capacity_factor"):
        R.apply_capacity(*_capacity_case(), topk=1, capacity_factor=0.0)
    with pytest.raises(ValueError, match="drop_policy"):
        R.apply_capacity(*_capacity_case(), topk=1, capacity_factor=1.0, drop_policy="random")


# --------------------------------------------------------------------------------------- losses
def test_switch_aux_loss_hand_worked():
    # T=2, E=2, k=1, coeff .1: factor E·coeff/(k·T²) = .05; Σ_t scores = [1.25, .75]
    scores = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    kw = dict(total_num_tokens=2, topk=1, num_experts=2, coeff=0.1)
    # balanced counts [1, 1]: .05·(1.25 + .75) = .1 (= coeff, the balanced optimum)
    _close(R.switch_aux_loss(scores, torch.tensor([1, 1]), **kw), 0.1)
    # all on expert 0: .05·(1.25·2) = .125
    _close(R.switch_aux_loss(scores, torch.tensor([2, 0]), **kw), 0.125)


def test_aux_loss_scores():
    # softmax: full softmax; sigmoid: sigmoid normalized to sum 1. top-1 of each
    logits = torch.tensor([[LN(1), LN(3)]])
    s, m = R.aux_loss_scores(logits, topk=1)
    _close(s, [[0.25, 0.75]])
    assert m.tolist() == [[False, True]]
    s, _ = R.aux_loss_scores(torch.tensor([[0.0, LN(3)]]), topk=1, score_function="sigmoid")
    _close(s, [[0.5 / 1.25, 0.75 / 1.25]])


def test_seq_aux_loss_hand_worked():
    # S=2, B=2, tokens t = s·B + b: t0=(s0,b0) t1=(s0,b1) t2=(s1,b0) t3=(s1,b1); E=2, k=1, coeff .1
    scores = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [1.0, 0.0]])
    rmap = torch.tensor([[1, 0], [1, 0], [0, 1], [1, 0]]).bool()
    counts = R.tokens_per_sequence_expert(rmap, num_sequences=2)
    assert counts.tolist() == [[1, 1], [2, 0]]
    # seq 0: Σ scores [1, 1], counts [1, 1] -> E·c/(k·S²)·2 = .05·2 = .1
    # seq 1: Σ scores [1.5, .5], counts [2, 0] -> .05·3 = .15; mean over B = .125
    loss = R.seq_aux_loss(scores, counts, num_sequences=2, seq_length=2, topk=1, num_experts=2, coeff=0.1)
    _close(loss, 0.125)
    # equals the mean of switch_aux_loss per sequence
    per_seq = [
        R.switch_aux_loss(scores[b::2], counts[b], total_num_tokens=2, topk=1, num_experts=2, coeff=0.1)
        for b in range(2)
    ]
    _close(loss, sum(per_seq) / 2)


def test_z_loss_hand_worked():
    # logsumexp([0, 0]) = ln2; logsumexp([0, ln3]) = ln4 = 2·ln2; mean of squares = 2.5·ln²2
    logits = torch.tensor([[0.0, 0.0], [0.0, LN(3)]])
    _close(R.z_loss(logits, coeff=0.1), 0.1 * 2.5 * LN(2) ** 2)


def test_expert_bias_update_rule():
    # counts [3, 1, 2, 2], mean 2: expert 0 overloaded (-rate), expert 1 underloaded (+rate)
    bias = torch.tensor([0.5, 0.0, -0.1, 0.0])
    new = R.updated_expert_bias(bias, torch.tensor([3, 1, 2, 2]), rate=0.01)
    _close(new, [0.49, 0.01, -0.1, 0.0])
    assert new.dtype == bias.dtype
