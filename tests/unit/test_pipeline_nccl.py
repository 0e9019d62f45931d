"""The pipeline's point-to-point traffic obeys NCCL's rules (simulated on CPU).

The op sequence is recorded from the real schedule executor (``forward_backward``) with a
recording stand-in for ``P2P``, rank by rank, then replayed through ``folding.testing.nccl_sim``:
one FIFO stream per rank, sends complete only with their matching receive, tags ignored. The
simulator itself is shown to catch a hand-made deadlock, a mismatch, and the deadlocks of the
previous design (async tagged ``isend`` + blocking ``irecv``).
"""

import itertools

import pytest
import torch

from folding.pipeline.comm_plan import Exchange, Pair, global_plan
from folding.pipeline.order import schedule_order
from folding.pipeline.schedules import forward_backward
from folding.testing.nccl_sim import Group, Op, WaitAll, simulate

SHAPE = (2, 1, 3)


class RecordingP2P:
    """Stands in for ``P2P``: records each ``exchange`` (peers in issue order), returns zeros."""

    def __init__(self, pp: int, pp_rank: int):
        self.pp, self.pp_rank = pp, pp_rank
        self.calls = []

    def exchange(self, *, sends, recvs):
        peer = lambda off: (self.pp_rank + off) % self.pp  # noqa: E731
        self.calls.append([("send", peer(off)) for off, _ in sends] + [("recv", peer(off)) for off, *_ in recvs])
        return [torch.zeros(tuple(shape), dtype=dtype) for _, shape, dtype, _ in recvs]


def recorded_programs(pp, vpp, M, forward_only=False, overlap=False):
    """Each rank's groups as ``forward_backward`` issues them, with the plan's message keys
    (``overlap``: the merged forward-backward pairs of ``parallel.overlap_moe_comm``)."""
    plan = global_plan(num_microbatches=M, pp=pp, vpp=vpp, forward_only=forward_only, overlap=overlap)
    programs = {}
    for r in range(pp):
        p2p = RecordingP2P(pp, r)
        w = torch.ones(SHAPE, requires_grad=True)

        def step(chunk, m, inp, r=r, w=w):
            x = (w if inp is None else inp) * 1.0
            return x.sum() if chunk * pp + r == pp * vpp - 1 else x

        forward_backward(
            forward_step=step,
            num_microbatches=M,
            pp_size=pp,
            pp_rank=r,
            vpp=vpp,
            p2p=p2p,
            tensor_shape=SHAPE,
            dtype=torch.float32,
            forward_only=forward_only,
            overlap=overlap,
        )
        exchanges = [a for a in plan[r] if isinstance(a, Exchange)]
        assert len(exchanges) == len(p2p.calls)
        groups = []
        for call, ex in zip(p2p.calls, exchanges):
            keys = [k for _, k in ex.sends] + [k for _, k in ex.recvs]
            assert len(keys) == len(call)
            groups.append(Group([Op(kind, peer, key) for (kind, peer), key in zip(call, keys)], wait=True))
        programs[r] = groups
    return programs


def old_design_programs(pp, vpp, M):
    """The op sequence of the previous executor: per step a blocking receive, then an async send
    (kept pending until the end of the schedule)."""
    V = pp * vpp
    programs = {}
    for r in range(pp):
        prog = []
        for kind, chunk, m in schedule_order(num_microbatches=M, pp_size=pp, pp_rank=r, vpp=vpp):
            v = chunk * pp + r
            if kind == "F":
                if v > 0:
                    prog.append(Group([Op("recv", (r - 1) % pp, ("F", v, m))], wait=True))
                if v < V - 1:
                    prog.append(Group([Op("send", (r + 1) % pp, ("F", v + 1, m))], wait=False))
            else:
                if v < V - 1:
                    prog.append(Group([Op("recv", (r + 1) % pp, ("B", v, m))], wait=True))
                if v > 0:
                    prog.append(Group([Op("send", (r - 1) % pp, ("B", v - 1, m))], wait=False))
        prog.append(WaitAll())
        programs[r] = prog
    return programs


def _grid():
    for pp, vpp in itertools.product([2, 3, 4, 8], [1, 2, 4]):
        counts = [pp, 2 * pp, 3 * pp] if vpp > 1 else [1, 3, pp, 2 * pp, 2 * pp + 1]
        for M in counts:
            yield pp, vpp, M


GRID = list(_grid())


def test_grid_covers_the_reported_cases():
    for case in [(2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8)]:  # (pp, vpp, micro-batches)
        assert case in GRID


@pytest.mark.parametrize("forward_only", [False, True])
def test_every_schedule_is_deadlock_free_under_nccl_rules(forward_only):
    for pp, vpp, M in GRID:
        result = simulate(recorded_programs(pp, vpp, M, forward_only))
        assert not result.deadlock and not result.mismatch, (pp, vpp, M, result.detail)


def test_every_merged_schedule_is_deadlock_free_under_nccl_rules():
    """The schedules of ``parallel.overlap_moe_comm`` (one more warm-up forward, then forward-backward
    pairs), executed by the real executor, obey the same rules on the whole grid."""
    pairs = 0
    for pp, vpp, M in GRID:
        result = simulate(recorded_programs(pp, vpp, M, overlap=True))
        assert not result.deadlock and not result.mismatch, (pp, vpp, M, result.detail)
        pairs += sum(
            isinstance(a, Pair) for prog in global_plan(num_microbatches=M, pp=pp, vpp=vpp, overlap=True) for a in prog
        )
    assert pairs > 0


def test_simulator_reports_a_head_to_head_deadlock():
    # both ranks block on a send before posting the receive the other one needs
    programs = {
        0: [Group([Op("send", 1, "a")]), Group([Op("recv", 1, "b")])],
        1: [Group([Op("send", 0, "b")]), Group([Op("recv", 0, "a")])],
    }
    assert simulate(programs).deadlock
    # the same four operations fused in one group per rank progress together
    fused = {0: [Group([Op("send", 1, "a"), Op("recv", 1, "b")])], 1: [Group([Op("send", 0, "b"), Op("recv", 0, "a")])]}
    result = simulate(fused)
    assert not result.deadlock and not result.mismatch


def test_simulator_reports_an_async_send_queued_before_a_receive():
    # rank 0's async send sits at the head of its stream while its host blocks on a receive
    # behind it; rank 1 does the same the other way round
    programs = {
        0: [Group([Op("send", 1, "a")], wait=False), Group([Op("recv", 1, "b")]), WaitAll()],
        1: [Group([Op("send", 0, "b")], wait=False), Group([Op("recv", 0, "a")]), WaitAll()],
    }
    assert simulate(programs).deadlock


def test_simulator_reports_messages_matched_out_of_order():
    programs = {
        0: [Group([Op("send", 1, "x")]), Group([Op("send", 1, "y")])],
        1: [Group([Op("recv", 0, "y")]), Group([Op("recv", 0, "x")])],
    }
    assert simulate(programs).mismatch


@pytest.mark.parametrize("case", [(2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8)])
def test_previous_design_deadlocks_under_nccl_rules(case):
    assert simulate(old_design_programs(*case)).deadlock
