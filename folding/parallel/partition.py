"""Stage partitioning: which transformer layers each virtual pipeline stage holds.

Layers are split evenly over ``V = pp·vpp`` virtual stages in order, or (``first_stage_layers``,
``last_stage_layers``) given numbers on the first and/or last pipeline stage and the rest evenly on
the others, or as a ``pipeline_layout`` string lists them (Megatron-Core's
``--pipeline-model-parallel-layout``, :mod:`folding.parallel.pipeline_layout`: any number of layers
per virtual stage, none included). Virtual stage ``v`` lives on pipeline rank ``v % pp`` as chunk
``v // pp``.

Usage::

    partition_layers(num_layers=32, pp=4, vpp=2)                       # 8 stages of 4 layers
    partition_layers(num_layers=61, pp=16, last_stage_layers=1)        # 15 stages of 4, then 1
    partition_layers(num_layers=94, pp=16, first_stage_layers=5, last_stage_layers=5)  # 5, 14 x 6, 5
    partition_layers(num_layers=61, pp=8, pipeline_layout="Et|(tt|)*30mL", mtp_num_layers=1)  # 1, 30 x 2, 0
    layers_of(rank=1, chunk=0, ...)                                   # range of layer indices
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from .pipeline_layout import check_pipeline_layout, layer_ranges


def partition_layers(
    *,
    num_layers: int,
    pp: int,
    vpp: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
    first_stage_layers: Optional[int] = None,
    pipeline_layout: Optional[str] = None,
    mtp_num_layers: int = 0,
) -> List[Tuple[int, int]]:
    """``[start, end)`` layer ranges of every virtual stage, in virtual-stage order.

    ``first_stage_layers`` / ``last_stage_layers`` (without vpp): the first / last pipeline stage
    holds that many layers and the stages between share the rest evenly (Megatron-Core's
    ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``).
    ``pipeline_layout``: the stages its string lists (vpp, when given, must be what it implies; a
    range is empty where a stage holds no transformer layer), its ``m`` count checked against
    ``mtp_num_layers`` (``model.mtp_num_layers``). Raises ``ValueError`` naming the settings when the
    layers cannot be split so.
    """
    if pipeline_layout is not None:
        if first_stage_layers is not None or last_stage_layers is not None:
            raise ValueError(
                f"parallel.pipeline_layout={pipeline_layout!r} lists every stage's layers: it cannot be combined "
                "with parallel.first_stage_layers / parallel.last_stage_layers; set those to null"
            )
        stages = check_pipeline_layout(pipeline_layout, pp=pp, vpp=vpp)
        return layer_ranges(stages, num_layers=num_layers, mtp_num_layers=mtp_num_layers, text=pipeline_layout)
    if first_stage_layers is not None or last_stage_layers is not None:
        ends = [n for n in (first_stage_layers, last_stage_layers) if n is not None]
        middle = pp - len(ends)
        rest = num_layers - sum(ends)
        if (
            (vpp or 1) > 1
            or pp < 2
            or min(ends) < 1
            or middle < 0
            or rest < middle
            or (rest % middle if middle else rest)
        ):
            given = ", ".join(
                f"parallel.{k}={v}"
                for k, v in (("first_stage_layers", first_stage_layers), ("last_stage_layers", last_stage_layers))
                if v is not None
            )
            raise ValueError(
                f"model.num_layers={num_layers} cannot be split as {given} on parallel.pp={pp} stages with "
                f"the {max(middle, 0)} other stage(s) sharing the rest evenly (no parallel.vpp); choose them "
                f"so that the other stages divide the remaining layers (at least one each)"
            )
        sizes = [first_stage_layers] if first_stage_layers is not None else []
        sizes += [rest // middle] * middle if middle else []
        sizes += [last_stage_layers] if last_stage_layers is not None else []
        bounds = [sum(sizes[:i]) for i in range(pp + 1)]
        return [(bounds[i], bounds[i + 1]) for i in range(pp)]
    V = pp * (vpp or 1)
    if num_layers % V or num_layers < V:
        raise ValueError(
            f"model.num_layers={num_layers} cannot be split evenly over {V} virtual stages "
            f"(parallel.pp={pp}, parallel.vpp={vpp or 1}); choose pp·vpp among the divisors of {num_layers}"
        )
    n = num_layers // V
    return [(v * n, (v + 1) * n) for v in range(V)]


def layout_stages(layout, *, num_layers: int, mtp_num_layers: int = 0) -> List[Tuple[int, int]]:
    """:func:`partition_layers` of a layout object (a :class:`~folding.parallel.ParallelLayout`, or any object
    with its ``pp``, ``vpp``, ``first_stage_layers``, ``last_stage_layers`` and ``pipeline_layout``)."""
    return partition_layers(
        num_layers=num_layers,
        pp=layout.pp,
        vpp=layout.vpp,
        last_stage_layers=layout.last_stage_layers,
        first_stage_layers=layout.first_stage_layers,
        pipeline_layout=layout.pipeline_layout,
        mtp_num_layers=mtp_num_layers,
    )


def layers_of(*, rank: int, chunk: int, pp: int, stages: List[Tuple[int, int]]) -> range:
    """Layer indices held by chunk ``chunk`` of pipeline rank ``rank``."""
    s, e = stages[chunk * pp + rank]
    return range(s, e)
