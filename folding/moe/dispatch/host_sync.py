"""The one instrumented device-to-host read of the MoE code path.

Every place in ``folding.moe`` that needs a device value on the host (split sizes for an uneven
all-to-all, the number of rows kept after token dropping) calls :func:`to_host`. On a GPU such a read
blocks the host until the device catches up, so the dispatcher performs at most one per layer in
dropless mode (deferred to just before the expert all-to-all needs its split sizes) and none with
pad-to-capacity. The counter lets tests and benchmarks check that promise.

Usage::

    from folding.moe.dispatch import host_sync
    before = host_sync.count()
    splits = host_sync.to_host(counts_RE, reason="alltoall splits")   # nested Python lists
    assert host_sync.count() - before == 1
"""

from __future__ import annotations

from typing import Any

import torch

_COUNT = 0


def to_host(t: torch.Tensor, *, reason: str) -> Any:
    """Copy ``t`` to the host and return it as Python numbers (``tensor.tolist()``).

    ``reason`` names the caller where the read happens (kept at every call site so that a profile or
    a failing count test points at it). This is a device-to-host synchronization on accelerators:
    call it once per layer at most.
    """
    global _COUNT
    _COUNT += 1
    return t.detach().to("cpu").tolist()


def count() -> int:
    """Total number of :func:`to_host` calls in this process since start-up (or the last reset)."""
    return _COUNT


def reset() -> None:
    """Set the counter back to zero."""
    global _COUNT
    _COUNT = 0
