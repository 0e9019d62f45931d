"""Where an 8-rank equivalence case spends its time: ``python -m tests.profile_suite [CASE ...]``.

Runs cases of ``tests/distributed/test_pipeline_training.py`` (indices into ``CASES``; default 0 and
4) on a fresh 8-rank pool with every ``torch.distributed`` collective counted by kind and group size
and timed (a blocking call: its wall time on the calling thread; an async one: counted only), and
prints, per case and rank: wall time of the run, CPU time of the process (all threads), time blocked
in collectives, and the collectives per optimizer step. The pool's start-up is timed separately.
The numbers feed docs/testing.md; nothing here is asserted."""

from __future__ import annotations

import collections
import functools
import sys
import time

import torch.distributed as dist

KINDS = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
    "barrier",
    "all_gather",
    "all_gather_object",
    "broadcast_object_list",
    "gather",
    "batch_isend_irecv",
    "isend",
    "irecv",
    "send",
    "recv",
)


def _instrumented(fn, kind, counts, blocked):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        group = kwargs.get("group")
        if group is None and kind in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier"):
            group = args[1] if kind == "all_reduce" and len(args) > 2 else None
        try:
            size = dist.get_world_size(group) if kind not in ("batch_isend_irecv",) else 2
        except Exception:
            size = -1
        counts[(kind, size)] += 1
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if not kwargs.get("async_op") and kind not in ("isend", "irecv", "batch_isend_irecv"):
            blocked[0] += time.perf_counter() - t0
        return out

    return wrapper


def profile_case(index: int, run_dir: str):
    """On every rank: train ``CASES[index]`` with collectives counted; return the rank's numbers."""
    from tests.distributed import test_pipeline_training as eq

    counts: collections.Counter = collections.Counter()
    blocked = [0.0]
    saved = {k: getattr(dist, k) for k in KINDS if hasattr(dist, k)}
    for k, fn in saved.items():
        setattr(dist, k, _instrumented(fn, k, counts, blocked))
    try:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        eq._train([eq.CASES[index]], run_dir, True, eq.STEPS)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        for k, fn in saved.items():
            setattr(dist, k, fn)
    return dict(wall=wall, cpu=cpu, blocked=blocked[0], counts=dict(counts))


def main(argv=None):
    import tempfile

    from folding.testing import RankPool
    from tests.distributed import test_pipeline_training as eq

    cases = [int(a) for a in (argv or sys.argv[1:])] or [0, 4]
    t0 = time.perf_counter()
    pool = RankPool(8)
    print(f"8-rank pool start-up: {time.perf_counter() - t0:.1f} s")
    try:
        with tempfile.TemporaryDirectory() as d:
            for i in cases:
                res = pool.run(profile_case, i, d, timeout_s=900)
                print(f"\ncase {i}: {eq.CASES[i][:3]}")
                for r, x in enumerate(res):
                    w, c, b = x["wall"], x["cpu"], x["blocked"]
                    print(f"  rank {r}: wall {w:.1f} s  cpu {c:.1f} s  blocked in collectives {b:.1f} s")
                per_step = collections.Counter()
                for x in res:
                    for (k, n), c in x["counts"].items():
                        per_step[(k, n)] += c
                total = sum(per_step.values()) / (8 * eq.STEPS)
                print(f"  collectives per rank per step (mean over ranks): {total:.1f}")
                for (k, n), c in sorted(per_step.items(), key=lambda kv: -kv[1]):
                    print(f"    {k:24s} group {n}: {c / (8 * eq.STEPS):.1f}")
    finally:
        pool.shutdown()


if __name__ == "__main__":
    main()
