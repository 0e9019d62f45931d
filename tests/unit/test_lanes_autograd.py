"""The two lanes of an overlap pair and the process-wide state they share (pure CPU, one process).

On CUDA the first lane's backward runs on the autograd engine's device thread and a hand-over parks
it there, so the second lane must never start a graph task (it would queue behind the parked one);
the second lane runs on one persistent thread; and the default generators, which non-reentrant
recompute forks and restores around work that hands over, are kept per lane.
"""

import threading

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from folding.moe.experts import backends as expert_backends
from folding.moe.experts.grouped import GroupedMLP
from folding.overlap.exchange import Exchange
from folding.overlap.lanes import LaneError
from folding.overlap.runtime import OverlapRuntime

overlap = OverlapRuntime()
"""The runtime every test of this file runs under (current through the autouse fixture below)."""


@pytest.fixture(autouse=True)
def _current_runtime():
    with overlap.active():
        yield


class _Done:
    def wait(self):
        pass


def _exchange():
    Exchange([_Done()], what="ep test").wait()


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]


def _graph(device="cpu"):
    w = torch.ones(3, requires_grad=True, device=device)
    return w, (w * 2).sum()


class _WaitInBackward(torch.autograd.Function):
    """Identity whose backward waits on an exchange: on CUDA it parks the engine's device thread."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _exchange()
        return g


# ------------------------------------------------------------------ a. no graph task in the 2nd lane
@pytest.mark.parametrize("device", DEVICES)
def test_a_backward_in_the_second_lane_raises_lane_error(device):
    trace = []

    def first():  # the schedule's backward lane: hands over from inside its backward
        w = torch.ones(3, requires_grad=True, device=device)
        _WaitInBackward.apply(w * 2).sum().backward()
        trace.append("first done")
        return w.grad

    def second():  # on CUDA this backward would queue behind the parked one for ever
        _, loss = _graph(device)
        loss.backward()
        trace.append("second went on")

    with pytest.raises(LaneError, match="second lane of an overlap pair started an autograd graph task"):
        overlap.run_pair(first, second)
    assert trace == ["first done"]  # the first lane ran to its end; the second stopped at its backward


def test_a_autograd_grad_in_a_hook_of_the_second_lane_raises_even_if_caught():
    def second():
        w, loss = _graph()
        try:  # e.g. a first-use probe that reads any failure as "unsupported"
            torch.autograd.grad(loss, w)
        except Exception:  # noqa: BLE001
            return "swallowed"

    with pytest.raises(LaneError):
        overlap.run_pair(_exchange, second)


def test_a_the_lanes_may_run_forwards_and_the_first_lane_backwards():
    w = torch.ones(3, requires_grad=True)
    a, b = overlap.run_pair(lambda: (w * 3).sum().backward(), lambda: (w * 5).sum())
    assert a is None and b.requires_grad and torch.equal(w.grad, torch.full((3,), 3.0))
    # outside a pair the helper thread's flag is down: a backward after the pair is fine
    b.backward()
    assert torch.equal(w.grad, torch.full((3,), 8.0))


def test_a_the_engine_is_guarded_only_while_a_pair_runs():
    from torch.autograd.variable import Variable

    engine = Variable._execution_engine
    seen = []
    overlap.run_pair(lambda: seen.append(Variable._execution_engine), lambda: None)
    assert seen[0] is not engine and seen[0].engine is engine  # the guard, in front of the engine
    assert Variable._execution_engine is engine  # the process's own engine again


# ------------------------------------------------------------------ b. first-use probes before pairs
@pytest.fixture
def probe_calls(monkeypatch):
    """Every run of the grouped-GEMM probe (the lane holding the baton, None outside a pair), from an
    empty probe cache."""
    calls = []
    probe = expert_backends._probe_grouped_mm

    def counting(*args):
        calls.append(overlap.running_lane())
        return probe(*args)

    expert_backends.torch_grouped_mm_supported.cache_clear()
    monkeypatch.setattr(expert_backends, "_probe_grouped_mm", counting)
    yield calls
    expert_backends.torch_grouped_mm_supported.cache_clear()


def _experts(device="cpu"):
    return GroupedMLP(
        num_experts=4, num_local_experts=4, hidden_size=16, ffn_hidden_size=16, backend="torch", device=device
    )


def test_b_the_backend_probe_runs_when_the_experts_are_built(probe_calls):
    m = _experts()
    assert probe_calls == [None]  # at build, outside any pair
    x = torch.randn(8, 16)
    overlap.run_pair(_exchange, lambda: m(x, [2, 2, 2, 2], torch.ones(8)))
    assert probe_calls == [None]  # the forward in the second lane probed nothing


def test_b_a_probe_in_the_second_lane_raises_and_leaves_no_verdict(probe_calls):
    m = _experts(device="meta")  # nothing is probed for a model built on meta
    assert probe_calls == []
    with pytest.raises(LaneError):
        overlap.run_pair(_exchange, lambda: expert_backends.torch_grouped_mm_supported("cpu", torch.float32))
    assert probe_calls == [1]
    # the failed probe is not cached as "unsupported": the next call, outside a pair, probes again
    expert_backends.torch_grouped_mm_supported("cpu", torch.float32)
    assert probe_calls == [1, None]
    assert m.fc1_weight.is_meta


# ------------------------------------------------------------------ c. one persistent helper thread
def test_c_the_second_lane_runs_on_one_persistent_thread():
    local = threading.local()
    seen = []

    def second(step):
        def run():
            _exchange()
            seen.append((threading.get_ident(), getattr(local, "built_in_step", None)))
            if step == 0:
                local.built_in_step = 0  # per-thread state built once, by the first pair

        return run

    for step in range(3):
        overlap.run_pair(_exchange, second(step))
    idents = {ident for ident, _ in seen}
    assert len(idents) == 1 and idents != {threading.get_ident()}
    assert idents == {overlap.lane_thread().ident}
    assert [built for _, built in seen] == [None, 0, 0]  # kept from the first pair, not rebuilt


# ------------------------------------------------------------------ e. generators across a hand-over
def _jittered(x):
    """A forward that draws (router jitter), then waits on an exchange (so its recompute hands over)."""
    h = x * torch.empty_like(x).uniform_(0.9, 1.1)
    _exchange()
    return (h * h).sum()


def _recompute_pair(paired: bool, device: str):
    torch.manual_seed(5)
    x0 = torch.randn(6, device=device, requires_grad=True)
    x1 = torch.randn(6, device=device, requires_grad=True)
    loss0 = checkpoint(_jittered, x0, use_reentrant=False)  # the earlier micro-batch's forward
    torch.rand(5, device=device)  # draws between the two (another micro-batch in flight)
    forward = lambda: checkpoint(_jittered, x1, use_reentrant=False)  # noqa: E731
    if paired:  # its backward (recompute forks the generator, sets the saved state, hands over)
        _, loss1 = overlap.run_pair(loss0.backward, forward)
    else:  # overlap off: the forward, then the backward
        loss1 = forward()
        loss0.backward()
    loss1.backward()
    rng = torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()
    return loss0.detach(), loss1.detach(), x0.grad, x1.grad, rng


@pytest.mark.parametrize("device", DEVICES)
def test_e_recompute_across_a_hand_over_draws_as_without_overlap(device):
    for a, b in zip(_recompute_pair(True, device), _recompute_pair(False, device)):
        assert torch.equal(a, b)


def test_e_lanes_draw_from_their_own_generator_copies():
    torch.manual_seed(1)
    start = torch.get_rng_state()

    def second():
        a = torch.rand(4)
        _exchange()
        return torch.cat([a, torch.rand(4)])

    def first():  # a recompute-like fork around a hand-over
        with torch.random.fork_rng():
            torch.manual_seed(99)
            _exchange()
            return torch.rand(4)

    got_first, got_second = overlap.run_pair(first, second)
    end = torch.get_rng_state()
    torch.set_rng_state(start)
    assert torch.equal(got_second, torch.rand(8))  # as if alone from the pair's start
    assert torch.equal(end, torch.get_rng_state())  # the pair kept the state of the lane that drew
    torch.manual_seed(99)
    assert torch.equal(got_first, torch.rand(4))  # the fork drew its own stream


def test_e_both_lanes_drawing_raises_lane_error():
    def draw():
        torch.rand(2)
        _exchange()

    with pytest.raises(LaneError, match="both lanes"):
        overlap.run_pair(draw, draw)
