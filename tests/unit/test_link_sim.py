"""The link model's rules on hand-made times (``folding.testing.link_sim``): one queue per communicator,
a link's bandwidth shared by the transfers on it, and a stream that waits while the host goes on."""

import pytest

from folding.testing.link_sim import LinkSim, Stream

GB = 1e9


def _sim(fifo=True, inter=None, intra=None):
    return LinkSim(bandwidth={"inter": inter, "intra": intra}, fifo=fifo)


def test_an_operation_waits_for_the_one_issued_before_it_on_its_communicator():
    sim = _sim(inter=1 * GB)
    tokens = sim.add("ep", {"inter": 10e6}, ready=0.0, latency=1e-3)  # 10 ms of bytes + 1 ms
    tp = sim.add("ep", {}, ready=0.002)  # a TP all-reduce on the same communicator, no bytes of its own
    own = sim.add("tp", {}, ready=0.002)  # the same on a communicator of its own
    for op in (tokens, tp, own):
        op.ready = op.ready  # all ready times known
    assert sim.finish(tokens) == pytest.approx(0.011)
    assert sim.finish(tp) == pytest.approx(0.011)  # queued behind the exchange, though issued 9 ms before it ends
    assert sim.finish(own) == pytest.approx(0.002)  # its own communicator: at once
    # without the rule nothing queues
    sim = _sim(fifo=False, inter=1 * GB)
    sim.add("ep", {"inter": 10e6}, ready=0.0, latency=1e-3)
    assert sim.finish(sim.add("ep", {}, ready=0.002)) == pytest.approx(0.002)


def test_two_transfers_on_one_link_each_take_twice_as_long():
    sim = _sim(inter=1 * GB, intra=9 * GB)
    a = sim.add("ep", {"inter": 4e6}, ready=0.0)
    b = sim.add("ep_meta", {"inter": 4e6}, ready=0.0)  # another communicator, the same NIC
    assert sim.finish(a) == pytest.approx(0.008) and sim.finish(b) == pytest.approx(0.008)  # 4 ms alone
    # one that starts halfway through the other's: shared while both run, then alone
    sim = _sim(inter=1 * GB)
    a = sim.add("ep", {"inter": 4e6}, ready=0.0)
    b = sim.add("dp", {"inter": 4e6}, ready=0.002)
    assert sim.finish(a) == pytest.approx(0.006)  # 2 MB alone, then 2 MB at half rate
    assert sim.finish(b) == pytest.approx(0.008)  # 2 MB at half rate (2-6 ms), then 2 MB alone: 8 MB in 8 ms
    # different link classes do not share: NVLink traffic leaves the NIC alone
    sim = _sim(inter=1 * GB, intra=1 * GB)
    a = sim.add("ep", {"inter": 4e6}, ready=0.0)
    b = sim.add("etp", {"intra": 4e6}, ready=0.0)
    assert sim.finish(a) == pytest.approx(0.004) and sim.finish(b) == pytest.approx(0.004)


def test_an_operation_on_two_classes_ends_with_its_slower_class_and_unset_bandwidth_is_free():
    sim = _sim(inter=1 * GB, intra=9 * GB)
    op = sim.add("ep", {"inter": 1e6, "intra": 18e6}, ready=0.0, latency=5e-4)
    assert sim.finish(op) == pytest.approx(0.0025)  # NVLink's 2 ms beat the NIC's 1 ms, then the latency
    sim = _sim(inter=None)
    assert sim.finish(sim.add("ep", {"inter": 1e12}, ready=1.0, latency=0.01)) == pytest.approx(1.01)
    assert sim.finish_all() == pytest.approx(1.01)


def test_a_ready_time_must_be_known_before_a_completion_is():
    sim = _sim(inter=1 * GB)
    op = sim.add("ep", {"inter": 1e6}, ready=None)
    with pytest.raises(RuntimeError, match="ready time"):
        sim.finish(op)


def test_the_stream_waits_and_the_host_pays_the_lag_at_its_next_sync():
    s = Stream()
    # host time 1.0: the stream waits for an exchange ending at 1.010 -> 10 ms behind, the host not held
    assert s.wait(1.010, now=1.0, what="ep dispatch") == pytest.approx(0.010)
    # compute runs on both; an operation issued at host time 1.004 is ready at the stream's 1.014
    assert s.time(1.004) == pytest.approx(1.014)
    # a wait on something already complete on the stream's clock costs nothing more
    assert s.wait(1.012, now=1.004) == 0.0
    # at host time 1.006 the stream is at 1.016: an exchange ending at 1.025 adds 9 ms
    assert s.wait(1.025, now=1.006, what="ep combine") == pytest.approx(0.009)
    assert s.idle_s == pytest.approx(0.019) and s.idle_by == pytest.approx({"ep dispatch": 0.01, "ep combine": 0.009})
    assert s.sync() == pytest.approx(0.019) and s.lag == 0.0  # the host's read pays the lag once
    assert s.sync() == 0.0


def test_while_the_host_is_blocked_for_real_the_stream_works_off_its_backlog():
    s = Stream()
    s.wait(1.010, now=1.0)  # 10 ms behind
    # the host blocks 4 ms in gloo (from stream time 1.012, host 1.002): the stream had work for all of it
    assert s.blocked(since=s.time(1.002), now=1.006, what="ep counts") == 0.0
    assert s.lag == pytest.approx(0.006)
    # a block of 9 ms more outlasts the backlog: 3 ms of it the stream stands idle too
    assert s.blocked(since=s.time(1.006), now=1.015, what="ep counts") == pytest.approx(0.003)
    assert s.lag == 0.0 and s.idle_by["ep counts"] == pytest.approx(0.003)


def test_a_started_operation_lets_go_of_its_predecessor():
    # every wait walks the chain of operations not started yet; a long run's chain must not grow with it
    sim = _sim()
    ops = [sim.add("ep", {}, ready=i * 1e-3) for i in range(200)]
    last = ops[-1]
    assert last.pred is ops[-2]  # issued: it waits for the one before it
    sim.finish(last)
    assert all(op.pred is None for op in ops)  # started: nothing keeps the chain alive
