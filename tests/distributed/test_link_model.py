"""The NCCL-wait link model on real gloo collectives: the spy sees every collective (an all-reduce that is
no exchange included), a wait returns at once, a collective queues behind the exchange issued before it
on its communicator, and the host pays at the end of the step."""

import time

import torch
import torch.distributed as dist

from folding.overlap.exchange import Exchange
from folding.overlap.runtime import OverlapRuntime
from folding.testing import link_model as lm


def _queued(latency_s: float):
    x = torch.ones(8, 4)
    out = torch.empty_like(x)
    grad = torch.ones(1000)
    dist.barrier()
    lm.traffic.reset()
    runtime = OverlapRuntime()
    with runtime.active(), lm.link_latency(runtime, latency_s) as links:
        t0 = time.perf_counter()
        w = dist.all_to_all_single(out, x, async_op=True)  # the world group: 32 bytes to each peer
        ex = Exchange([w], what="ep dispatch")
        dist.all_reduce(grad)  # a gradient reduction on the same communicator, issued behind the exchange
        issued = time.perf_counter() - t0
        ex.wait()
        waited = time.perf_counter() - t0
        idle = links.idle_by
        paid = lm.sync()
        took = time.perf_counter() - t0
    assert torch.equal(grad, torch.full((1000,), 4.0))  # the data is what gloo delivered
    return dict(waited=waited, issued=issued, idle=idle, paid=paid, took=took, sent=lm.traffic.intra_node_bytes)


def test_waits_return_at_once_and_everything_takes_its_place(ranks):
    latency = 0.6  # long beside a loaded host's real gloo waits (tenths of a second at a load of 25)
    for r, res in enumerate(ranks(4).run(_queued, latency)):
        assert res["waited"] < latency / 2 and res["issued"] < latency / 2, (r, res)  # no wait blocked the host
        # the blocking all-reduce made the stream wait for itself, queued behind the exchange: the stream
        # stood through the exchange there, and the exchange's own wait found it complete
        assert res["idle"]["all_reduce"] > latency - 0.1, (r, res)
        assert res["idle"].get("ep dispatch", 0.0) < 0.05, (r, res)
        assert res["paid"] > latency / 2 and res["took"] >= latency, (r, res)  # paid at the end of the step
        assert res["sent"] == 3 * 32, (r, res)  # the EP exchange's bytes to its three peers


def _late_sender(latency_s: float):
    me = dist.get_rank()
    x, out = torch.ones(8, 4), torch.empty(8, 4)
    dist.barrier()
    runtime = OverlapRuntime()
    with runtime.active(), lm.link_latency(runtime, latency_s) as links:
        t0 = time.perf_counter()
        w = dist.all_to_all_single(out, x, async_op=True)
        ex = Exchange([w], what="ep dispatch")
        if me % 2 == 0:  # the senders' streams fall behind: they wait for the exchange, their hosts go on
            ex.wait()
            ops = [dist.P2POp(dist.isend, torch.ones(4), me + 1)]
        else:
            ops = [dist.P2POp(dist.irecv, torch.empty(4), me - 1)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        host = time.perf_counter() - t0
        idle = links.idle_by
        ex.wait()
        lm.sync()
    return dict(host=host, idle=idle)


def test_a_receive_waits_for_the_senders_stream(ranks):
    latency = 0.6
    for r, res in enumerate(ranks(4).run(_late_sender, latency)):
        assert res["host"] < latency / 2, (r, res)  # nobody's host waited
        if r % 2 == 1:  # the sender's stream reached the send only after the exchange: so does the receive
            assert res["idle"]["p2p recv"] > latency - 0.1, (r, res)
