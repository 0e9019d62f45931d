"""The rank pool reports a failing rank's traceback and times out instead of hanging."""

import pytest
import torch
import torch.distributed as dist

from folding.testing import RankFailure


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    return dist.get_rank()


def _hang_on_rank_zero():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.zeros(1))  # the other ranks never join: a hang
    return dist.get_rank()


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_results_in_rank_order(ranks, world):
    assert ranks(world).run(_sum_of_ranks) == [float(sum(range(world)))] * world


def test_failure_carries_traceback(ranks):
    pool = ranks(2)
    with pytest.raises(RankFailure) as err:
        pool.run(_fail_on_rank_one)
    assert "boom from rank one" in str(err.value) and "rank(s) [1]" in str(err.value)
    assert not pool.alive  # a rank that raised may have left the world inconsistent
    assert ranks(2).run(_sum_of_ranks) == [1.0, 1.0]  # a fresh pool replaces it


def test_hang_times_out(ranks):
    pool = ranks(2)
    with pytest.raises(TimeoutError):
        pool.run(_hang_on_rank_zero, timeout_s=5)
    assert not pool.alive
    assert ranks(2).run(_sum_of_ranks) == [1.0, 1.0]  # a fresh pool replaces it
