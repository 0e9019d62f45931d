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


class _Cyclic:
    """An object in a reference cycle (freed only by the cyclic collector), as a model holding groups is."""

    def __init__(self):
        self.me = self


_left = []  # weak references to what a call left in cycles, per rank process


def _leave_a_cycle():
    import weakref

    _left.append(weakref.ref(_Cyclic()))
    return len(_left)


def _cycle_freed_and_frozen():
    import gc

    return _left[-1]() is None, gc.get_freeze_count()


def test_what_a_call_leaves_in_cycles_is_freed_and_what_survives_is_frozen(ranks):
    # each call ends with a collection (a task's cycles, e.g. models holding process groups, go at once)
    # and then freezes what survived, so later collections do not walk the rank's long-lived objects
    pool = ranks(2)
    pool.run(_leave_a_cycle)
    for freed, frozen in pool.run(_cycle_freed_and_frozen):
        assert freed
        assert frozen > 10_000  # torch's and the modules' objects
