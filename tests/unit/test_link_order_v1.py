"""NCCL's order in the CPU link model: an operation on a process group completes no earlier than every
operation issued before it on that group (one communicator, one order), a separate group has its own
order, and the rule is on by default (``folding.testing.link_model``)."""

import time

import pytest

from folding.overlap.exchange import Exchange
from folding.overlap.runtime import OverlapRuntime
from folding.testing import link_model_v1 as lm
from folding.testing.link_model_v1 import link_latency

RT = OverlapRuntime()
"""The runtime the link model subscribes to and the exchanges bind to (current in every test)."""


@pytest.fixture(autouse=True)
def _current_runtime():
    with RT.active():
        yield


EP, COUNTS = object(), object()  # stand-ins for two process groups over the same ranks


def test_an_operation_completes_after_those_issued_before_it_on_its_group():
    assert lm.LinkModel().nccl_order  # default on
    with link_latency(RT, 0.2):
        t0 = time.perf_counter()
        tokens = Exchange([], what="ep dispatch", group=EP)  # 200 ms in flight on EP
        counts = lm.issue(EP, 0.0)  # a count all-gather issued behind it on the same group
        own = lm.issue(COUNTS, 0.0)  # the same on a group of its own
        assert counts >= lm.completion(tokens) >= t0 + 0.2
        assert own < t0 + 0.1  # its own communicator: not behind the tokens
        slept = lm.complete(counts)
        assert slept > 0.1 and time.perf_counter() >= lm.completion(tokens)
        tokens.wait()  # already complete: no further wait
        assert time.perf_counter() - t0 < 0.2 + 0.1


def test_without_the_rule_or_the_group_nothing_waits_behind():
    with link_latency(RT, 0.2, nccl_order=False):
        t0 = time.perf_counter()
        Exchange([], what="ep dispatch", group=EP)
        assert lm.issue(EP, 0.0) < t0 + 0.1
    with link_latency(RT, 0.2):
        t0 = time.perf_counter()
        Exchange([], what="ep dispatch")  # no group named: no order kept
        assert lm.issue(None, 0.0) < t0 + 0.1
    assert lm.issue(EP, 0.0) is None  # outside a model: nothing modelled
