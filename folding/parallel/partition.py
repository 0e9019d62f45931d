"""Stage partitioning: which transformer layers each virtual pipeline stage holds.

Layers are split evenly over ``V = pp·vpp`` virtual stages in order, or (``last_stage_layers``) a
given number on the last pipeline stage and the rest evenly on the others, (virtual stage ``v`` lives on
pipeline rank ``v % pp`` as chunk ``v // pp``).

Usage::

    partition_layers(num_layers=32, pp=4, vpp=2)                       # 8 stages of 4 layers
    partition_layers(num_layers=61, pp=16, last_stage_layers=1)        # 15 stages of 4, then 1
    layers_of(rank=1, chunk=0, ...)                                   # range of layer indices
"""

from __future__ import annotations

from typing import List, Optional, Tuple


def partition_layers(
    *, num_layers: int, pp: int, vpp: Optional[int] = None, last_stage_layers: Optional[int] = None
) -> List[Tuple[int, int]]:
    """``[start, end)`` layer ranges of every virtual stage, in virtual-stage order.

    ``last_stage_layers`` (without vpp): the last stage holds that many layers and the other ``pp - 1``
    stages share the rest evenly (Megatron-Core's ``--decoder-last-pipeline-num-layers``). Raises
    ``ValueError`` naming the settings when the layers cannot be split so.
    """
    if last_stage_layers is not None:
        rest = num_layers - last_stage_layers
        if (vpp or 1) > 1 or pp < 2 or last_stage_layers < 1 or rest < pp - 1 or rest % (pp - 1):
            raise ValueError(
                f"model.num_layers={num_layers} cannot be split as parallel.last_stage_layers={last_stage_layers} "
                f"on the last of parallel.pp={pp} stages and the rest evenly on the others (no parallel.vpp); "
                f"choose last_stage_layers so that pp-1 divides num_layers - last_stage_layers"
            )
        n = rest // (pp - 1)
        return [(v * n, (v + 1) * n) for v in range(pp - 1)] + [(rest, num_layers)]
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
