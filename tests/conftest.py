"""Shared pytest fixtures: long-lived gloo rank pools reused by every distributed test."""

import pytest

from folding.testing import RankPool


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
