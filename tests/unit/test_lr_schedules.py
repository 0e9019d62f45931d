"""LR schedules: hand-worked values, purity in the step (horizon from the config, not the run)."""

import math

import pytest

from folding.optim import OptimConfig, lr_at


def cfg(**kw):
    base = dict(lr=1.0, min_lr=0.1, warmup_steps=2, decay_steps=10)
    base.update(kw)
    return OptimConfig(**base)


def test_warmup_is_linear_from_the_first_step():
    c = cfg(decay_style="constant", warmup_steps=4)
    assert [lr_at(k, c) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_hand_values():
    c = cfg(decay_style="cosine")
    # after warmup (step 2) progress = (k-2)/8; lr = 0.1 + 0.9 * (1 + cos(pi * progress)) / 2
    assert lr_at(2, c) == pytest.approx(1.0)
    assert lr_at(6, c) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: cos(pi/2) = 0
    assert lr_at(10, c) == pytest.approx(0.1) and lr_at(1000, c) == pytest.approx(0.1)


def test_linear_hand_values():
    c = cfg(decay_style="linear")
    assert [round(lr_at(k, c), 6) for k in (2, 4, 6, 8, 10)] == [1.0, 0.775, 0.55, 0.325, 0.1]


def test_wsd_stable_then_decay():
    c = cfg(decay_style="wsd", wsd_decay_fraction=0.5)
    # stable until step 5 = 10*(1-0.5), then linear to min_lr at 10
    assert [round(lr_at(k, c), 6) for k in range(12)] == [
        0.5,
        1.0,
        1.0,
        1.0,
        1.0,
        1.0,
        0.82,
        0.64,
        0.46,
        0.28,
        0.1,
        0.1,
    ]
    s = cfg(decay_style="wsd", wsd_decay_fraction=0.5, wsd_decay_shape="sqrt")
    assert lr_at(9, s) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.8)))


def test_horizon_not_run_length():
    # decay_steps fixes the horizon: train.steps does not change the LR at any step
    c = cfg(decay_style="cosine")
    assert [lr_at(k, c, train_steps=5) for k in range(12)] == [lr_at(k, c, train_steps=500) for k in range(12)]
    # decay_steps=None: the horizon is train.steps
    d = cfg(decay_style="cosine", decay_steps=None)
    assert lr_at(6, d, train_steps=10) == pytest.approx(lr_at(6, c))
    with pytest.raises(ValueError, match="optim.decay_steps"):
        lr_at(6, d)


@pytest.mark.parametrize(
    "bad,field",
    [
        (dict(lr=-1.0), "optim.lr"),
        (dict(min_lr=2.0), "optim.min_lr"),
        (dict(decay_style="exp"), "optim.decay_style"),
        (dict(warmup_steps=-1), "optim.warmup_steps"),
        (dict(warmup_steps=20), "optim.warmup_steps"),
        (dict(clip_grad=-1.0), "optim.clip_grad"),
        (dict(beta2=1.0), "optim.beta2"),
        (dict(eps=0.0), "optim.eps"),
        (dict(wsd_decay_fraction=1.5), "optim.wsd_decay_fraction"),
        (dict(decay_steps=0), "optim.decay_steps"),
        (dict(weight_decay=-0.1), "optim.weight_decay"),
        (dict(bucket_size=0), "optim.bucket_size"),
    ],
)
def test_validation_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        cfg(**bad)


def test_clip_zero_or_none_is_off_and_valid():
    assert cfg(clip_grad=0).clip_grad == 0 and cfg(clip_grad=None).clip_grad is None
