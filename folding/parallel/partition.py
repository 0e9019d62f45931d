"""Stage partitioning: which transformer layers each virtual pipeline stage holds.

Layers are split evenly over ``V = pp·vpp`` virtual stages in order (virtual stage ``v`` lives on
pipeline rank ``v % pp`` as chunk ``v // pp``).

Usage::

    partition_layers(num_layers=32, pp=4, vpp=2)                       # 8 stages of 4 layers
    layers_of(rank=1, chunk=0, ...)                                   # range of layer indices
"""

from __future__ import annotations

from typing import List, Optional, Tuple


def partition_layers(*, num_layers: int, pp: int, vpp: Optional[int] = None) -> List[Tuple[int, int]]:
    """``[start, end)`` layer ranges of every virtual stage, in virtual-stage order.

    Raises ``ValueError`` naming the settings when the layers cannot be split evenly.
    """
    V = pp * (vpp or 1)
    if num_layers % V or num_layers < V:
        raise ValueError(
            f"model.num_layers={num_layers} cannot be split evenly over {V} virtual stages "
            f"(parallel.pp={pp}, parallel.vpp={vpp or 1}); choose pp·vpp among the divisors of {num_layers}"
        )
    n = num_layers // V
    return [(v * n, (v + 1) * n) for v in range(V)]


def layers_of(*, rank: int, chunk: int, pp: int, stages: List[Tuple[int, int]]) -> range:
    """Layer indices held by chunk ``chunk`` of pipeline rank ``rank``."""
    s, e = stages[chunk * pp + rank]
    return range(s, e)
