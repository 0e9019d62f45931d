"""Weight-decay groups and parameter classes read from tags, dims and names; clip coefficient."""

import torch

from folding.optim import classify, uses_weight_decay
from folding.optim.clip import clip_coefficient
from folding.parallel.params import mark_param


def P(*shape, **tags):
    return mark_param(torch.nn.Parameter(torch.zeros(*shape)), **tags)


def test_decay_rules():
    assert uses_weight_decay("layers.0.attn.qkv.weight", P(6, 4))
    assert uses_weight_decay("layers.0.moe.experts.w1", P(2, 4, 6))
    assert not uses_weight_decay("layers.0.input_norm.weight", P(4))  # norm scale, 1-D
    assert not uses_weight_decay("layers.0.attn.qkv.bias", P(6))  # bias
    assert not uses_weight_decay("layers.0.moe.router.expert_bias", P(8))  # router expert bias
    assert not uses_weight_decay("layers.0.moe.experts.fc1_bias", P(2, 6))  # stacked expert bias
    assert not uses_weight_decay("layers.0.q_norm.weight", P(1, 4))  # a norm with an extra dim


def test_classes_follow_tags():
    c = classify("moe.experts.w1", P(2, 4, 6, expert=True, tp_sharded=True))
    assert c.expert and c.tp_sharded and c.decay and c.dtype == "float32"
    r = classify("moe.router.weight", P(8, 4, sequence_parallel=True))
    assert not r.expert and r.sequence_parallel and not r.tp_sharded
    e = classify("embedding.weight", P(16, 4, tp_sharded=True, embedding_tied=True))
    assert e.embedding_tied and e != classify("embedding.weight", P(16, 4, tp_sharded=True))
    assert "expert/tp_sharded/decay/float32" == c.describe()


def test_clip_coefficient():
    assert clip_coefficient(2.0, 1.0) == 1.0 / (2.0 + 1e-6)
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(5.0, 0) == 1.0 and clip_coefficient(5.0, None) == 1.0
