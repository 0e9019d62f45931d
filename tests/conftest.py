"""Shared pytest fixtures: long-lived gloo rank pools reused by every distributed test; one intra-op
thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``).

The suite runs on two pytest-xdist workers (``-n 2 --dist loadgroup`` in ``pytest.ini``): each worker
uses one intra-op thread (two workers fill the two cores; more threads would only contend), and the
tests that share results within a session (an equivalence parameter that reuses another's runs) are
kept on one worker by an ``xdist_group`` (:data:`SHARED_RUNS`). Every other test may run on either
worker beside any other, so none may depend on running alone."""

import os

import pytest
import torch

from folding.testing import RankPool

# test-id prefixes whose tests reuse each other's runs through module-level caches: one worker each
SHARED_RUNS = {
    # overlap_on and memory compare bitwise with overlap_off's 8-rank runs of the same cases (two halves)
    "tests/distributed/test_pipeline_training.py::test_layouts_train_like_one_rank[overlap_off_a]": "equivalence-a",
    "tests/distributed/test_pipeline_training.py::test_layouts_train_like_one_rank[overlap_on_a]": "equivalence-a",
    "tests/distributed/test_pipeline_training.py::test_layouts_train_like_one_rank[overlap_off_b]": "equivalence-b",
    "tests/distributed/test_pipeline_training.py::test_layouts_train_like_one_rank[overlap_on_b]": "equivalence-b",
    "tests/distributed/test_pipeline_training.py::test_layouts_train_like_one_rank[memory_a]": "equivalence-a",
    "tests/distributed/test_pipeline_training.py::test_layouts_train_like_one_rank[memory_b]": "equivalence-b",
    "tests/distributed/test_pipeline_training.py::test_deepseek_v3_layouts_train_like_one_rank": "equivalence-deepseek",
    # the paper's planner searches (one per model and folding), cached in the module and shared by its tests
    "tests/unit/test_planner_paper.py": "planner-paper",
    # replicas_overlap compares bitwise with the replicas parameter's runs of the same cases
    "tests/distributed/test_pipeline_training.py::test_layouts_train_like_one_rank[replicas]": "equivalence-replicas",
    "tests/distributed/test_pipeline_training.py::test_layouts_train_like_one_rank[replicas_overlap]": (
        "equivalence-replicas"
    ),
}

if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker of a parallel run: one core's worth of threads
    torch.set_num_threads(1)


# the longest files first (test time in the last .ci/run, most first): the two workers take the work in this
# order, so the long equivalence groups start at once instead of ending the run alone on one worker
LONGEST_FIRST = (
    "tests/distributed/test_pipeline_training.py",
    "tests/distributed/test_entry_point.py",
    "tests/distributed/test_checkpoint_reshard.py",
    "tests/distributed/test_model_parallel.py",
    "tests/distributed/test_model_from_hf.py",
    "tests/distributed/test_megatron_start.py",
    "tests/unit/test_planner_paper.py",
)


def pytest_collection_modifyitems(config, items):
    """Keep the tests of each :data:`SHARED_RUNS` prefix on one xdist worker, and run the files of
    :data:`LONGEST_FIRST` first (in that order; the others after them, in collection order)."""
    for item in items:
        for prefix, group in SHARED_RUNS.items():
            if item.nodeid.startswith(prefix):
                item.add_marker(pytest.mark.xdist_group(group))

    def rank(item):
        path = item.nodeid.split("::")[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: within a file, the collection order


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
