"""Cross-check of the routing functions against Megatron-Core's own helpers on random inputs.

Runs only where ``megatron-core`` is importable (it is not a dependency of folding); elsewhere the
module is skipped with that reason. Tie-free random inputs are used, since Megatron-Core leaves ties
to ``torch.topk``; the ``position`` drop policy and pad-to-capacity filler choice are therefore not
compared (ours are deterministic, theirs depend on ``torch.topk`` tie order).
"""

import pytest
import torch

from folding.moe.routing import functions as R
from tests.optional import require

mu = require("megatron.core.transformer.moe.moe_utils", reason="megatron-core is not installed (optional cross-check)")

CASES = [
    dict(topk=2, score_function="softmax", pre_softmax=False),
    dict(topk=1, score_function="softmax", pre_softmax=True),
    dict(topk=3, score_function="softmax", pre_softmax=True, scaling=2.5),
    dict(topk=4, score_function="softmax", pre_softmax=False, num_groups=4, group_topk=2),
    dict(topk=2, score_function="sigmoid", pre_softmax=False),
    dict(topk=1, score_function="sigmoid", pre_softmax=False, bias=True),
    dict(topk=4, score_function="sigmoid", pre_softmax=False, num_groups=2, group_topk=2, bias=True, scaling=1.5),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_topk_routing_equals_megatron(case, dtype):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(32, 8, generator=g, dtype=dtype)
    bias = torch.randn(8, generator=g, dtype=dtype) * 0.3 if case.get("bias") else None
    kw = dict(num_groups=case.get("num_groups"), group_topk=case.get("group_topk"))
    ours = R.topk_routing(
        logits,
        topk=case["topk"],
        score_function=case["score_function"],
        pre_softmax=case["pre_softmax"],
        scaling_factor=case.get("scaling"),
        expert_bias_E=bias,
        **kw,
    )
    theirs = mu.topk_routing_with_score_function(
        logits,
        case["topk"],
        use_pre_softmax=case["pre_softmax"],
        scaling_factor=case.get("scaling"),
        score_function=case["score_function"],
        expert_bias=bias,
        **kw,
    )
    assert torch.equal(ours[1], theirs[1])
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cf", [0.5, 1.0, 1.3, 5.0])
def test_capacity_equals_megatron(cf):
    g = torch.Generator().manual_seed(4)
    probs, rmap = R.topk_routing(torch.randn(24, 8, generator=g), topk=2)
    cap = R.expert_capacity(24, topk=2, num_experts=8, capacity_factor=cf)
    assert cap == mu.get_capacity(24 * 2, 8, cf)
    ours = R.apply_capacity(probs, rmap, topk=2, capacity_factor=cf)
    theirs = mu.apply_router_token_dropping(probs, rmap, 2, cf, drop_policy="probs")
    assert torch.equal(ours[1], theirs[1])
    torch.testing.assert_close(ours[0], theirs[0])
    # padded: the same routed pairs survive and every expert has the same row count as theirs
    ours_p = R.apply_capacity(probs, rmap, topk=2, capacity_factor=cf, pad_to_capacity=True)
    theirs_p = mu.apply_router_token_dropping(probs, rmap, 2, cf, pad_to_capacity=True)
    assert torch.equal(ours_p[1] & rmap, theirs_p[1] & rmap)
    assert torch.equal(ours_p[1].sum(0), theirs_p[1].sum(0))
    torch.testing.assert_close(ours_p[0], theirs_p[0])


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_losses_and_bias_rule_equal_megatron(score_function):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(20, 8, generator=g)
    scores, amap = R.aux_loss_scores(logits, topk=2, score_function=score_function)
    their_map, their_scores = mu.compute_routing_scores_for_aux_loss(logits, 2, score_function)
    assert torch.equal(amap, their_map)
    torch.testing.assert_close(scores, their_scores)
    counts = amap.sum(0)
    torch.testing.assert_close(
        R.switch_aux_loss(scores, counts, total_num_tokens=20, topk=2, num_experts=8, coeff=0.01),
        mu.switch_load_balancing_loss_func(their_scores, counts, 20, 2, 8, 0.01),
    )
    torch.testing.assert_close(R.z_loss(logits, coeff=0.001), mu.z_loss_func(logits, 0.001))
    # seq_aux_loss: Megatron-Core reshapes [S, B·E] and divides the switch loss by B
    S, B = 5, 4
    seq_counts = R.tokens_per_sequence_expert(amap, num_sequences=B)
    ours = R.seq_aux_loss(scores, seq_counts, num_sequences=B, seq_length=S, topk=2, num_experts=8, coeff=0.01)
    theirs = mu.switch_load_balancing_loss_func(scores.reshape(S, -1), amap.reshape(S, -1).sum(0), S, 2, 8, 0.01) / B
    torch.testing.assert_close(ours, theirs)
    # the bias rule, without Megatron-Core's all-reduce (which needs its global process groups)
    bias = torch.randn(8, generator=g)
    tpe = counts.float()
    ref = bias + torch.sign(tpe.sum(-1, keepdim=True) / 8 - tpe) * 1e-3
    torch.testing.assert_close(R.updated_expert_bias(bias, tpe, rate=1e-3), ref)
