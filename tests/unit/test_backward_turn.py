"""The backward's own hand-over (``folding.overlap.backward_turn``): a backward lane gives the baton to the
other lane where the marked tensor's gradient is ready, and nothing else changes."""

import torch

from folding.overlap.backward_turn import turn_in_backward
from folding.overlap.runtime import OverlapRuntime


def _pair(runtime, mark: bool):
    log = []
    w = torch.randn(4, 4, requires_grad=True)

    def backward_lane():
        x = w * 2
        y = turn_in_backward(x) if mark else x
        z = (y * 3).sum()
        log.append("backward starts")
        z.backward()
        log.append("backward ends")
        return w.grad.clone()

    def other_lane():
        log.append("other lane")

    with runtime.active():
        grad, _ = runtime.run_pair(backward_lane, other_lane)
    return log, grad


def test_the_backward_hands_over_where_the_gradient_is_ready():
    runtime = OverlapRuntime()
    with runtime:
        log, grad = _pair(runtime, mark=True)
        assert log == ["backward starts", "other lane", "backward ends"]
        assert runtime.stats.hand_overs == 1
        plain, plain_grad = _pair(runtime, mark=False)
        assert plain == ["backward starts", "backward ends", "other lane"]  # no turn without the mark
    assert torch.equal(grad, torch.full((4, 4), 6.0)) and torch.equal(grad, plain_grad)


def test_outside_a_runtime_it_is_the_tensor_itself():
    x = torch.ones(3, requires_grad=True)
    assert turn_in_backward(x) is x
