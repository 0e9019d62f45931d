"""The lost-peer verdict of :class:`folding.launch.watchdog.PeerWatch` on a real TCP store, with this rank's
clock passed in: a peer whose heartbeat stops changing for half of ``train.collective_timeout_s`` is named
with its node and host, one that never set a heartbeat is lost as long after the first look, one that
finished (``done``) never is, and a store that stops answering is lost too."""

import datetime

import torch.distributed as dist

from folding.launch.watchdog import PeerWatch


def _store(port=None):
    if port is None:
        return dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False, use_libuv=True)
    return dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=datetime.timedelta(seconds=2))


def _watch(master, rank, **kw):
    store = dist.PrefixStore("run/", _store(master.port))
    return PeerWatch(store, rank=rank, world_size=3, timeout_s=4, node=str(rank // 2), host=f"h{rank // 2}", **kw)


def _beat(*watches):
    for w in watches:  # a set is not acknowledged: a read on the same connection makes it visible to all
        w._beat()
        w.store.get(str(w.rank))


def test_a_silent_peer_is_named_after_half_the_timeout():
    master = _store()
    w0, w1, w2 = (_watch(master, r) for r in range(3))
    _beat(w0, w1)
    assert w0.check(now=0.0) is None  # rank 2 has not started: not lost yet
    _beat(w1)
    assert w0.check(now=1.9) is None
    _beat(w1)
    assert w0.check(now=2.0) == (
        "lost rank 2 (node ?, host ?): no heartbeat for 2.0 s (train.collective_timeout_s=4): exiting"
    )
    _beat(w2)
    assert w0.check(now=2.5) is None  # it came: alive
    w1.close(done=True)  # rank 1 finished: never lost
    w1.store.get("1")
    _beat(w2)
    assert w0.check(now=3.0) is None
    assert w0.check(now=4.9) is None
    assert w0.check(now=5.0) == (
        "lost rank 2 (node 1, host h1): no heartbeat for 2.0 s (train.collective_timeout_s=4): exiting"
    )


def test_several_lost_ranks_one_line_and_a_lost_store():
    master = _store()
    w0, w1, w2 = (_watch(master, r) for r in range(3))
    _beat(w0, w1, w2)
    assert w0.check(now=0.0) is None
    assert w0.check(now=2.5) == (
        "lost ranks 1, 2 (nodes 0, 1, hosts h0, h1): no heartbeat for 2.5 s (train.collective_timeout_s=4): exiting"
    )
    del master  # the store's host is gone
    w0.where = " at 127.0.0.1:1"
    assert w0.check(now=10.0) is None  # not answering, not yet for long
    line = w0.check(now=12.0)
    assert line.startswith("lost the job's store at 127.0.0.1:1 (torchrun of node 0): it has not answered for 2.0 s")


def test_the_watch_thread_exits_or_leaves_the_exit_to_a_failed_collective():
    master = _store()
    exits, reported = [], []
    w0 = _watch(master, 0, interval_s=0.05, exit=exits.append, on_lost=reported.append)
    w0.stale_s = 0.3
    _beat(_watch(master, 1), _watch(master, 2))
    w0.start()
    line = w0.verdict(wait_s=5.0)  # as after a collective raised: the line comes back, no exit from the thread
    w0.close(done=False)
    assert line.startswith("lost ranks 1, 2 (nodes 0, 1, hosts h0, h1): no heartbeat for")
    assert exits == [] and reported == []
    w = _watch(master, 0, interval_s=0.05, exit=exits.append, on_lost=reported.append)
    w.stale_s = 0.3
    w.start()
    w._thread.join(timeout=5.0)
    assert exits == [3] and reported[0].startswith("lost ranks 1, 2")


def test_only_a_failed_collective_waits_for_the_verdict():
    from folding.launch.watchdog import collective_failure

    gloo = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:50613")
    assert collective_failure(gloo) and collective_failure(dist.DistBackendError("NCCL watchdog"))
    try:
        try:
            raise gloo
        except RuntimeError as inner:
            raise ValueError("while reducing the loss") from inner
    except ValueError as outer:
        assert collective_failure(outer)
    assert not collective_failure(ValueError("a bug")) and not collective_failure(RuntimeError("shape mismatch"))
