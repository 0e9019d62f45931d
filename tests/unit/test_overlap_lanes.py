"""The two-lane scheduler of ``parallel.overlap_moe_comm`` (pure CPU, one process).

Lanes hand over only at an exchange wait, in a fixed order; deferred work runs inside the next wait
(in the grad mode it was deferred in); a lane's exception reaches the caller; the paired schedule
keeps forwards and backwards in their order; delayed weight gradients are bitwise the plain ones.
"""

import pytest
import torch

from folding.moe.experts.grouped import GroupedMLP
from folding.overlap.exchange import Exchange
from folding.overlap.runtime import OverlapRuntime
from folding.pipeline.order import schedule_order

overlap = OverlapRuntime()
"""The runtime every test of this file runs under (current through the autouse fixture below)."""


@pytest.fixture(autouse=True)
def _current_runtime():
    with overlap.active():
        yield


class _Done:
    def wait(self):
        pass


def _lane(name, trace, exchanges):
    def run():
        for i in range(exchanges):
            trace.append(f"{name}{i} start")
            Exchange([_Done()], what="ep test").wait()
            trace.append(f"{name}{i} end")
        return name

    return run


def test_lanes_take_turns_at_every_exchange():
    trace = []
    assert overlap.run_pair(_lane("a", trace, 2), _lane("b", trace, 3)) == ("a", "b")
    # a starts; each start hands over; once a has ended, b runs on alone
    assert trace == ["a0 start", "b0 start", "a0 end", "a1 start", "b0 end", "b1 start", "a1 end", "b1 end",
                     "b2 start", "b2 end"]  # fmt: skip


def test_an_exception_in_a_lane_reaches_the_caller_after_both_end():
    trace = []

    def bad():
        Exchange([_Done()], what="ep test").wait()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        overlap.run_pair(bad, _lane("b", trace, 2))
    assert trace[-1] == "b1 end"  # the other lane ran to its end


def test_deferred_work_runs_in_the_next_wait_with_its_grad_mode():
    w = torch.ones(2, requires_grad=True)
    d = overlap.defer(lambda: (w * 2).sum())
    with torch.no_grad():  # an exchange waited on inside an autograd function's forward
        Exchange([_Done()], what="ep test").wait()
    assert d.result().requires_grad


def test_a_lanes_deferred_work_runs_in_that_lane_around_the_other_lanes_piece():
    trace = []

    def first():
        for name in ("fc2 wgrad", "fc1 wgrad"):
            overlap.defer(lambda name=name: trace.append((name, overlap.running_lane())))
        trace.append("a issues")
        Exchange([_Done()], what="ep test").wait()
        trace.append("a waited")

    def second():
        trace.append("b runs")
        Exchange([_Done()], what="ep test").wait()  # must not run the first lane's work
        trace.append("b waited")

    overlap.run_pair(first, second)
    # half of the work before the hand-over, the rest once the baton is back, each in the first lane
    assert trace == ["a issues", ("fc2 wgrad", 0), "b runs", ("fc1 wgrad", 0), "a waited", "b waited"]


def test_paired_schedule_keeps_the_order_of_forwards_and_backwards():
    for pp, vpp, M in [(1, 1, 4), (2, 1, 6), (4, 2, 8)]:
        for r in range(pp):
            plain = schedule_order(num_microbatches=M, pp_size=pp, pp_rank=r, vpp=vpp)
            paired = schedule_order(num_microbatches=M, pp_size=pp, pp_rank=r, vpp=vpp, overlap=True)
            flat = [s for p in paired for s in ([("F",) + p[1:3], ("B",) + p[3:5]] if p[0] == "FB" else [p])]
            assert [s for s in flat if s[0] == "F"] == [s for s in plain if s[0] == "F"]
            assert [s for s in flat if s[0] == "B"] == [s for s in plain if s[0] == "B"]
            assert any(p[0] == "FB" for p in paired)
    # no pipelining: one forward of warm-up, then pairs, then one backward
    assert schedule_order(num_microbatches=3, pp_size=1, pp_rank=0, vpp=1, overlap=True) == [
        ("F", 0, 0),
        ("FB", 0, 1, 0, 0),
        ("FB", 0, 2, 0, 1),
        ("B", 0, 2),
    ]


# shapes where (xᵀ·g)ᵀ and torch's gᵀ·x round differently: an ETP2 shard (F/2 = 8) and padded widths
@pytest.mark.parametrize("hidden,ffn,etp", [(32, 16, 1), (32, 16, 2), (12, 8, 1), (10, 6, 1)])
def test_delayed_weight_gradients_are_bitwise_the_plain_ones(hidden, ffn, etp):
    def run(delay):
        m = GroupedMLP(num_experts=4, num_local_experts=4, hidden_size=hidden, ffn_hidden_size=ffn, etp_size=etp,
                       etp_rank=0, expert_offset=0, backend="torch", init_seed=3, delay_wgrad=delay)  # fmt: skip
        x = torch.randn(20, hidden, generator=torch.Generator().manual_seed(1), requires_grad=True)
        p = torch.rand(20, generator=torch.Generator().manual_seed(2))
        for _ in range(2):  # the second accumulates onto the first
            y = m(x, torch.tensor([5, 0, 7, 8]), p)
            (y * y).sum().backward()  # no exchange ran the deferred work: the end of the backward did
            assert not overlap.deferred.pending()
        return x.grad, m.fc1_weight.grad, m.fc2_weight.grad

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)
