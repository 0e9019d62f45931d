"""The link model that waits like NCCL (``folding.testing.link_model``), without process groups: a wait
returns at once and the host pays at its first read; every collective takes its place in its
communicator's order; ETP collectives cost their bytes."""

import time

import pytest
import torch

from folding.moe.dispatch import host_sync
from folding.overlap.exchange import Exchange
from folding.overlap.runtime import OverlapRuntime
from folding.testing import link_model as lm
from folding.testing import link_spy
from folding.testing.link_model_v1 import LinkModel

EP, TP = "ep", "tp"  # stand-ins for two communicators
RT = OverlapRuntime()
"""The runtime whose exchanges the model names (current in every test)."""


@pytest.fixture(autouse=True)
def _current_runtime():
    with RT.active():
        yield


class _Done:
    """A real collective that has already completed (gloo's part of the wait)."""

    def wait(self, *a, **k):
        return True


def _issue(links, group, kind="all_to_all_single", nbytes=None):
    """A collective issued now on ``group``, as the spy reports it; returns its work."""
    op = links.issued(group, group, 0, 2, nbytes or {}, kind)
    return link_spy.SpyWork(_Done(), op, links)


def test_a_wait_returns_at_once_and_the_first_host_read_pays():
    with lm.link_latency(RT, 0.2, peer_issue=False) as links:
        t0 = time.perf_counter()
        w = _issue(links, EP)
        Exchange([w], what="ep dispatch").wait()  # NCCL: the stream waits, the host goes on
        assert time.perf_counter() - t0 < 0.1
        assert links.idle_s > 0.15 and links.idle_by.keys() == {"ep dispatch"}
        assert links.host_s == 0.0
        counts = host_sync.to_host(torch.tensor([3, 1]), reason="test")  # the host needs a result
        assert counts == [3, 1]
        assert time.perf_counter() - t0 >= 0.2  # it caught up with the stream here
        assert links.host_by.keys() == {"count read"} and links.host_s > 0.15
        t1 = time.perf_counter()
        assert lm.sync() == 0.0 and time.perf_counter() - t1 < 0.05  # nothing left to pay
    assert host_sync.to_host.__name__ == "to_host" and not hasattr(host_sync.to_host, "__wrapped__")


def test_the_end_of_a_step_waits_for_collectives_nobody_waited_on():
    with lm.link_latency(RT, 0.1, peer_issue=False):
        t0 = time.perf_counter()
        w = _issue(lm.current(), EP)
        Exchange([w], what="ep combine")  # issued, never waited on
        assert lm.sync() > 0.05 and time.perf_counter() - t0 >= 0.1


def test_a_tp_all_reduce_queues_behind_an_exchange_on_its_communicator():
    with lm.link_latency(RT, 0.2, peer_issue=False) as links:
        t0 = time.perf_counter()
        Exchange([_issue(links, EP)], what="ep dispatch")  # in flight: 200 ms
        _issue(links, EP, "all_reduce").wait()  # TP sharing EP's communicator: the stream waits behind it
        assert links.idle_by.get("all_reduce", 0.0) > 0.15
        links.reset()
        Exchange([_issue(links, EP)], what="ep combine")
        _issue(links, TP, "all_reduce").wait()  # a communicator of its own: not behind it
        assert links.idle_s < 0.05
        assert time.perf_counter() - t0 < 0.1  # no wait blocked the host
    with lm.link_latency(RT, 0.2, peer_issue=False, nccl_order=False) as links:
        Exchange([_issue(links, EP)], what="ep dispatch")
        _issue(links, EP, "all_reduce").wait()  # without the rule nothing queues
        assert links.idle_s < 0.05


def test_etp_collectives_cost_their_bytes():
    model = LinkModel(nvlink_domain=2)
    # an ETP all-gather of 1 MB blocks over global ranks 0 and 1 (one node): 1 MB each way on NVLink
    x, out = torch.empty(250_000), torch.empty(500_000)
    nbytes, _ = link_spy.class_bytes(
        model, "all_gather_into_tensor", {"input_tensor": x, "output_tensor": out}, [0, 1], 0
    )
    assert nbytes == {"inter": 0.0, "intra": 1e6}
    # the ETP reduce-scatter of the combine (an all-to-all of blocks, fp32 partials): its split sizes
    rows = torch.empty(6, 4)  # 16 bytes per row; 2 rows to rank 2 (another node), 4 kept
    nbytes, _ = link_spy.class_bytes(
        model,
        "all_to_all_single",
        {"input": rows, "output": rows, "input_split_sizes": [4, 2], "output_split_sizes": [4, 2]},
        [0, 2],
        0,
    )
    assert nbytes == {"inter": 32.0, "intra": 0.0}
    with lm.link_model(RT, intra_node_bandwidth=1e7, nvlink_domain=2, peer_issue=False) as links:
        w = _issue(links, "etp", "all_gather_into_tensor", {"intra": 1e6})
        Exchange([w], what="etp all-gather").wait()  # not an EP exchange: no latency, but 100 ms of bytes
        assert links.idle_by["etp all-gather"] == pytest.approx(0.1, abs=0.02)


def test_two_exchanges_in_flight_share_the_link():
    with lm.link_model(RT, inter_node_bandwidth=1e7, peer_issue=False) as links:
        a = _issue(links, EP, nbytes={"inter": 5e5})
        b = _issue(links, "ep_rail", nbytes={"inter": 5e5})  # another communicator, the same NIC
        a.wait()
        assert links.idle_s == pytest.approx(0.1, abs=0.02)  # 50 ms alone, 100 ms shared
        b.wait()
        assert links.idle_s == pytest.approx(0.1, abs=0.02)  # ended together


def test_one_model_at_a_time_and_the_rules_are_reported():
    with lm.link_latency(RT, 0.01, peer_issue=False) as links:
        rules = links.rules()
        assert rules["link_rules"] == lm.RULES and rules["wait_blocks_host"] is False
        assert "all_reduce" in rules["modelled"] and rules["nccl_order"]
        with pytest.raises(RuntimeError, match="already installed"):
            with lm.link_latency(RT, 0.01):
                pass
    assert lm.current() is None
