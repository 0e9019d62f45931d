"""Shared pytest fixtures: long-lived gloo rank pools reused by every distributed test; one intra-op
thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""

import pytest
import torch

from folding.testing import RankPool


@pytest.fixture(scope="module")
def one_thread():
    """Run the module's tests with one intra-op thread (tiny GEMMs, where OpenMP synchronization
    dominates), then restore the previous count."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def ranks():
    """``ranks(n)`` returns a live :class:`RankPool` of ``n`` gloo ranks, started once per session
    (and restarted if an earlier test killed it). Distributed tests call ``ranks(n).run(fn, ...)``."""
    pools = {}

    def get(n: int) -> RankPool:
        pool = pools.get(n)
        if pool is None or not pool.alive:
            pool = pools[n] = RankPool(n)
        return pool

    yield get
    for pool in pools.values():
        pool.shutdown()
