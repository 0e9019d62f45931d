"""Pipeline schedule orders: every step exactly once, dependencies respected, no deadlock."""

import pytest

from folding.pipeline.order import schedule_order


def simulate(M, pp, vpp):
    """Run every rank's order with blocking receives: a forward of virtual stage v needs the forward of
    v-1 for the same micro-batch; a backward of v needs the backward of v+1. Fails on a deadlock."""
    V = pp * vpp
    orders = {r: schedule_order(num_microbatches=M, pp_size=pp, pp_rank=r, vpp=vpp) for r in range(pp)}
    pos = {r: 0 for r in range(pp)}
    done = set()
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, c, m = orders[r][pos[r]]
                v = c * pp + r
                if kind == "F":
                    ready = v == 0 or ("F", v - 1, m) in done
                else:
                    ready = ("F", v, m) in done and (v == V - 1 or ("B", v + 1, m) in done)
                if not ready:
                    break
                done.add((kind, v, m))
                pos[r] += 1
                progress = True
    stuck = {r: orders[r][pos[r]] for r in range(pp) if pos[r] < len(orders[r])}
    assert not stuck, f"deadlock at {stuck}"
    return orders


@pytest.mark.parametrize(
    "pp,vpp,M",
    [
        (1, 1, 1),
        (1, 1, 5),
        (2, 1, 1),
        (2, 1, 3),
        (4, 1, 2),
        (4, 1, 8),
        (2, 2, 2),
        (2, 2, 6),
        (4, 2, 4),
        (4, 2, 12),
        (4, 3, 8),
        (8, 2, 16),
    ],
)
def test_schedule_complete_and_deadlock_free(pp, vpp, M):
    orders = simulate(M, pp, vpp)
    for r, order in orders.items():
        f = [(c, m) for k, c, m in order if k == "F"]
        b = [(c, m) for k, c, m in order if k == "B"]
        expected = sorted((c, m) for c in range(vpp) for m in range(M))
        assert sorted(f) == expected and sorted(b) == expected
        # a backward never precedes its forward on the same rank
        seen = set()
        for k, c, m in order:
            if k == "F":
                seen.add((c, m))
            else:
                assert (c, m) in seen


def test_1f1b_warmup_counts():
    # pp=4: rank r runs pp-r-1 forwards before its first backward
    for r in range(4):
        order = schedule_order(num_microbatches=8, pp_size=4, pp_rank=r, vpp=1)
        first_b = next(i for i, s in enumerate(order) if s[0] == "B")
        assert first_b == (4 - r - 1) + 1


def test_interleaved_needs_multiple_of_pp():
    with pytest.raises(ValueError, match="multiple of parallel.pp"):
        schedule_order(num_microbatches=3, pp_size=2, pp_rank=0, vpp=2)
