"""bench_overlap's own logic without running a model: the link rules and a communicator per concurrent role
by default, and the medians over repeated runs with their loads."""

import pytest

from benchmarks import bench_overlap as bo
from folding.testing import link_model


def test_the_nccl_wait_model_is_the_default_and_the_earlier_one_is_kept():
    ns = bo._args([])
    assert ns.link_rules == link_model.RULES and ns.own_communicators is True and ns.repeats == 1
    assert bo._args(["--link-rules", "exchange-wait"]).link_rules == "exchange-wait"
    a = bo._settings(bo._args(["--no-own-communicators"]), 10.0)
    assert a["link_rules"] == link_model.RULES and a["own_communicators"] is False


def test_medians_over_runs_with_their_loads():
    def run(hidden, ratio, load):
        return dict(
            layout="ep4", link_latency_ms=10.0, hidden=hidden, step_time_ratio=ratio, load_before=load, load_after=load
        )

    runs = [run(0.70, 0.75, (1.0,)), run(0.60, 0.85, (2.0,)), run(0.66, 0.79, (3.0,)), run(None, 1.0, (4.0,))]
    (row,) = bo.summarize(runs)
    assert row["repeats"] == 4 and row["hidden_median"] == 0.66  # the run without exposure left out
    assert row["ratio_median"] == pytest.approx(0.82) and row["loads"][1] == [(2.0,), (2.0,)]
