"""Stage partitioning: which transformer layers each virtual pipeline stage holds.

Layers are split over ``V = pp·vpp`` virtual stages in order (virtual stage ``v`` lives on pipeline
rank ``v % pp`` as chunk ``v // pp``). By default every virtual stage gets the same number of layers;
``first_stage_layers`` / ``last_stage_layers`` give the first / last virtual stage fewer (or more)
layers to balance the embedding and the output layer, and the rest are split evenly.

Usage::

    partition_layers(num_layers=32, pp=4, vpp=2)                       # 8 stages of 4 layers
    partition_layers(num_layers=30, pp=4, first_stage_layers=6, last_stage_layers=6)
    layers_of(rank=1, chunk=0, ...)                                   # range of layer indices
"""

from __future__ import annotations

from typing import List, Optional, Tuple


def partition_layers(
    *,
    num_layers: int,
    pp: int,
    vpp: Optional[int] = None,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
) -> List[Tuple[int, int]]:
    """``[start, end)`` layer ranges of every virtual stage, in virtual-stage order.

    Raises ``ValueError`` naming the setting when the layers cannot be split as asked.
    """
    V = pp * (vpp or 1)
    if V == 1:
        return [(0, num_layers)]
    counts: List[Optional[int]] = [None] * V
    if first_stage_layers is not None:
        counts[0] = first_stage_layers
    if last_stage_layers is not None:
        counts[-1] = last_stage_layers
    fixed = sum(c for c in counts if c is not None)
    free = [i for i, c in enumerate(counts) if c is None]
    rest = num_layers - fixed
    if any(c is not None and c < 0 for c in counts) or rest < 0:
        raise ValueError(
            f"pipeline.first_stage_layers/last_stage_layers ({first_stage_layers}, "
            f"{last_stage_layers}) exceed model.num_layers={num_layers}"
        )
    if free:
        if rest % len(free):
            raise ValueError(
                f"model.num_layers={num_layers} cannot be split evenly over {len(free)} virtual stages "
                f"(pp={pp}, vpp={vpp or 1}, first_stage_layers={first_stage_layers}, "
                f"last_stage_layers={last_stage_layers}); change parallel.pp/vpp or set the first/last "
                f"stage layer counts"
            )
        for i in free:
            counts[i] = rest // len(free)
    elif rest:
        raise ValueError(f"first/last stage layers leave {rest} of model.num_layers={num_layers} unassigned")
    if any(c < 1 for c in counts):
        raise ValueError(
            f"every virtual stage needs at least one layer; got {counts} for "
            f"model.num_layers={num_layers}, pp={pp}, vpp={vpp or 1}"
        )
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


def layers_of(*, rank: int, chunk: int, pp: int, stages: List[Tuple[int, int]]) -> range:
    """Layer indices held by chunk ``chunk`` of pipeline rank ``rank``."""
    s, e = stages[chunk * pp + rank]
    return range(s, e)
