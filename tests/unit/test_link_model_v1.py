"""The two-class CPU link model: an exchange completes no earlier than latency + its bytes over the
bandwidth of each link class it uses (inter-node, intra-node), its wait sleeping for the rest."""

import time

import pytest

from folding.overlap.exchange import ETP_ROWS, Exchange
from folding.overlap.runtime import OverlapRuntime
from folding.testing import link_model_v1 as lm

RT = OverlapRuntime()
"""The runtime the link model subscribes to and the exchanges bind to (current in every test)."""


@pytest.fixture(autouse=True)
def _current_runtime():
    with RT.active():
        yield


def test_duration_is_latency_plus_the_slower_class():
    m = lm.LinkModel(latency_s=0.001, inter_node_bandwidth=1e6, intra_node_bandwidth=9e6, nvlink_domain=4)
    # 1 MB across nodes: 1 s; 9 MB inside the node: 1 s; the classes carry their bytes at once
    assert m.duration(1e6, 9e6) == pytest.approx(1.001)
    assert m.duration(2e6, 9e6) == pytest.approx(2.001)  # the NIC is the slower class
    assert m.duration(0, 18e6) == pytest.approx(2.001)  # only NVLink used
    assert m.duration(0, 0) == pytest.approx(0.001)  # latency alone
    # an unset bandwidth is unlimited
    assert lm.LinkModel(latency_s=0.5, intra_node_bandwidth=1e6).duration(1e9, 0) == pytest.approx(0.5)


def test_bytes_per_class_from_global_ranks():
    m = lm.LinkModel(inter_node_bandwidth=1.0, nvlink_domain=4)
    b = lm.LinkBytes()
    # global rank 5 sits on node 1 (ranks 4..7); a group of ranks 1, 3, 5, 7
    b.add(m, 5, [1, 3, 5, 7], send_bytes=[10, 20, 30, 40], recv_bytes=[1, 2, 3, 4])
    assert (b.inter_sent, b.inter_recv) == (30, 3)  # to / from ranks 1 and 3 (node 0)
    assert (b.intra_sent, b.intra_recv) == (40, 4)  # rank 7; its own 30 / 3 are a local copy
    # each class costs its larger direction
    b.inter_recv = 50
    assert b.duration(m) == pytest.approx(50.0)
    # without nvlink_domain every rank shares one node
    one = lm.LinkBytes()
    one.add(lm.LinkModel(latency_s=1.0), 0, [0, 1], [5, 6], [7, 8])
    assert (one.inter_sent, one.intra_sent, one.intra_recv) == (0, 6, 8)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="inter_node_bandwidth"):
        lm.LinkModel(inter_node_bandwidth=0)
    with pytest.raises(ValueError, match="latency"):
        with lm.link_latency(RT, -1):
            pass


def _timed_wait(make):
    """Seconds from just before ``make()`` issues an exchange until its wait returns (the model
    completes it a duration after its issue, so the time from the issue is what is bounded)."""
    t0 = time.perf_counter()
    make().wait()
    return time.perf_counter() - t0


def test_exchange_waits_for_its_modelled_completion():
    lm.traffic.reset()
    with lm.link_model(RT, latency_s=0.02, inter_node_bandwidth=1e6, intra_node_bandwidth=9e6, nvlink_domain=2):
        # 60 kB over the NIC (60 ms) beats 90 kB over NVLink (10 ms): at least 20 + 60 ms
        sent = lm.LinkBytes(inter_sent=60e3, intra_sent=90e3)
        assert _timed_wait(lambda: Exchange([], what="ep dispatch", messages=sent)) >= 0.08
        assert (lm.traffic.inter_node_bytes, lm.traffic.intra_node_bytes, lm.traffic.exchanges) == (60e3, 90e3, 1)
        # an exchange without bytes pays the latency
        assert _timed_wait(lambda: Exchange([], what="ep combine")) >= 0.02
    # outside the block nothing is delayed and nothing counted
    lm.traffic.reset()
    assert _timed_wait(lambda: Exchange([], what="x", messages=lm.LinkBytes(inter_sent=1e9))) < 0.5
    assert lm.traffic.exchanges == 0


def test_link_latency_keeps_its_meaning():
    with lm.link_latency(RT, 0.2):
        assert lm.current().latency_s == 0.2
        assert _timed_wait(lambda: Exchange([], what="ep dispatch")) >= 0.2
        # an exchange that is not an EP one (ETP) is not delayed (half the latency: room for a busy host)
        assert _timed_wait(lambda: Exchange([], what="etp", carries=ETP_ROWS)) < 0.1
    assert not lm.current().active


def test_a_peer_published_a_moment_late_costs_about_that_moment(tmp_path):
    # the last-sender lookup reads the peers' issue times from the ranks' store; the test ranks' store is
    # a file store, whose own wait polls every 10 ms: a peer 1 ms late must not cost this rank 10 ms more
    import threading

    import torch.distributed as dist

    store = dist.PrefixStore("g", dist.FileStore(str(tmp_path / "store"), 1))
    store.set(lm._key("ep", 0, 1), repr(1.0))
    lags = []  # from the late peer's publish to the lookup's return
    for seq in range(1, 8):
        published = []

        def publish(seq=seq, published=published):
            store.set(lm._key("ep", seq, 2), repr(2.0 + seq))
            published.append(time.perf_counter())

        peer = threading.Timer(0.001, publish)
        store.set(lm._key("ep", seq, 1), repr(1.0))
        peer.start()
        latest = lm._last_issue(store, "ep", seq, 0, 3, 0.5)
        returned = time.perf_counter()
        peer.join()  # the lookup may return between the peer's store write and its clock read
        lags.append(returned - published[0])
        assert latest == 2.0 + seq  # the late peer's time, read once it is there
    # median: the poll's pause (at most 1 ms, plus a loaded host's wake-up), not the rest of a 10 ms
    # period (never under 9 ms here: the first check fails, the next comes 10 ms after it)
    assert sorted(lags)[3] < 0.008, lags
    # a peer that never publishes falls back to this rank's own time (counted) after the timeout
    saved, lm.PEER_TIMEOUT_S = lm.PEER_TIMEOUT_S, 0.05
    try:
        lm.traffic.reset()
        assert lm._last_issue(store, "ep", 99, 0, 3, 0.5) == 0.5
        assert lm.traffic.peer_fallbacks == 2
        store.set(lm._key("ep", 100, 1), repr(7.0))
        assert lm._last_issue(store, "ep", 100, 0, 3, 0.5) == 7.0  # the one that did publish counts
        assert lm.traffic.peer_fallbacks == 3
    finally:
        lm.PEER_TIMEOUT_S = saved
