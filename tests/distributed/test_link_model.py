"""The NCCL-wait link model on real gloo collectives: the spy sees every collective (an all-reduce that is
no exchange included), a wait returns at once, a collective queues behind the exchange issued before it
on its communicator, and the host pays at the end of the step."""

import time

import torch
import torch.distributed as dist

from folding.parallel.overlap import Exchange
from folding.testing import link_model as lm


def _queued(latency_s: float):
    x = torch.ones(8, 4)
    out = torch.empty_like(x)
    grad = torch.ones(1000)
    dist.barrier()
    lm.traffic.reset()
    with lm.link_latency(latency_s) as links:
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
    latency = 0.3
    for r, res in enumerate(ranks(4).run(_queued, latency)):
        assert res["waited"] < latency / 2 and res["issued"] < latency / 2, (r, res)  # no wait blocked the host
        # the blocking all-reduce made the stream wait for itself, queued behind the exchange: the stream
        # stood through the exchange there, and the exchange's own wait found it complete
        assert res["idle"]["all_reduce"] > latency - 0.1, (r, res)
        assert res["idle"].get("ep dispatch", 0.0) < 0.05, (r, res)
        assert res["paid"] > latency / 2 and res["took"] >= latency, (r, res)  # paid at the end of the step
        assert res["sent"] == 3 * 32, (r, res)  # the EP exchange's bytes to its three peers
