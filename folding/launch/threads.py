"""How many CPU threads each training process uses.

PyTorch's default intra-op thread count is the host's physical core count, which ignores both the
number of processes sharing the node and a container's CPU quota: four ranks in a 2-CPU container on
a 64-core host each start 32 threads that spin against each other. torchrun sets
``OMP_NUM_THREADS=1`` for that reason; plain ``python`` sets nothing. :func:`configure_threads` makes
every launch pick a count itself, in this order:

1. ``train.threads`` when set;
2. ``OMP_NUM_THREADS`` when the environment sets it (torchrun does: 1 per process);
3. the CPUs this process may use (its affinity mask, capped by the cgroup quota in
   ``/sys/fs/cgroup/cpu.max``), divided by the processes on this node (``LOCAL_WORLD_SIZE``), at least 1.

Usage::

    threads, why = configure_threads(job.train.threads)      # before the model is built
    print(f"threads: {threads} per process ({why})")
"""

from __future__ import annotations

import math
import os
from typing import Optional, Tuple

import torch

CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"


def cgroup_cpu_limit(path: str = CGROUP_CPU_MAX) -> Optional[float]:
    """CPUs allowed by a cgroup-v2 quota (``"<quota> <period>"`` in ``path``), or ``None`` when the
    file is absent, unreadable or says ``max`` (no quota)."""
    try:
        with open(path, encoding="ascii") as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        q, p = float(quota), float(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def usable_cpus(cpu_max_path: str = CGROUP_CPU_MAX) -> int:
    """CPUs this process can run on: its affinity mask, capped by the cgroup quota (rounded up)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(cpu_max_path)
    if limit is not None:
        cpus = min(cpus, max(1, math.ceil(limit)))
    return max(1, cpus)


def pick_threads(setting: Optional[int], *, env=None, cpus: Optional[int] = None) -> Tuple[int, str]:
    """The thread count for one process and the reason, following the module's rules.

    ``setting`` is ``train.threads``; ``env`` defaults to ``os.environ``; ``cpus`` to
    :func:`usable_cpus`.
    """
    env = os.environ if env is None else env
    if setting is not None:
        return int(setting), "train.threads"
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1:
        return int(omp), f"OMP_NUM_THREADS={omp}"
    cpus = usable_cpus() if cpus is None else cpus
    local = env.get("LOCAL_WORLD_SIZE", "1")
    procs = int(local) if local.isdigit() and int(local) >= 1 else 1
    n = max(1, cpus // procs)
    return n, f"{cpus} usable CPUs / {procs} process{'es' if procs > 1 else ''} on this node"


def configure_threads(setting: Optional[int]) -> Tuple[int, str]:
    """Apply :func:`pick_threads` with ``torch.set_num_threads``; returns ``(threads, reason)``."""
    n, why = pick_threads(setting)
    torch.set_num_threads(n)
    return n, why
