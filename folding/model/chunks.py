"""This rank's model chunks for training: the model cut into ``pp·vpp`` virtual pipeline stages.

Chunk ``c`` of pipeline rank ``r`` is virtual stage ``c·pp + r`` (:mod:`folding.parallel.partition`).
Each chunk is a :class:`~folding.model.transformer.MoETransformer` restricted to its layer range
(parameter names keep the global layer index, so checkpoints do not depend on the cut); the first
virtual stage holds the embedding, the last one the final norm and output layer (and, with tied
embeddings, its own copy of the table, whose gradient is summed with the first stage's over the
embedding group; with multi-token prediction, also the MTP modules and a copy of the table).
:func:`folding.pipeline.stage.run_microbatches` runs a step through them.

Usage::

    chunks = build_stage_chunks(model_config=job.model, parallel_state=ps, recompute="none")
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
from torch import nn

from ..moe.layer import MoELayer
from ..parallel.partition import partition_layers
from .block import RECOMPUTE_MODES
from .config import ModelConfig
from .transformer import MoETransformer


def build_stage_chunks(
    *,
    model_config: ModelConfig,
    parallel_state,
    recompute: str = "none",
    overlap_moe_comm: bool = False,
    delay_wgrad: bool = False,
    params_dtype: torch.dtype = torch.float32,
    init_seed: int = 0,
    device=None,
    moe_factory: Optional[Callable[..., nn.Module]] = None,
) -> List[nn.Module]:
    """The chunks (one per virtual stage this rank holds, in chunk order), initialized identically
    whatever the layout. The MoE blocks follow ``model_config.moe``; ``moe_factory`` (default:
    :func:`folding.model.moe_block.default_moe_factory`) replaces the MoE block entirely.
    ``overlap_moe_comm`` (``parallel.overlap_moe_comm``) has every MoE layer compute its shared expert
    while its own dispatch is in flight, ``delay_wgrad`` (``parallel.delay_wgrad``) its experts compute
    their weight gradients behind the backward dispatch (a layer from another factory may ignore them)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"train.recompute={recompute!r}: choose one of {RECOMPUTE_MODES}")
    layout = parallel_state.layout
    pp, vpp = layout.pp, layout.virtual_stages
    stages = partition_layers(
        num_layers=model_config.num_layers,
        pp=pp,
        vpp=vpp,
        last_stage_layers=layout.last_stage_layers,
        first_stage_layers=layout.first_stage_layers,
    )
    chunks = []
    for c in range(vpp):
        chunk = MoETransformer(
            model_config,
            parallel_state=parallel_state,
            init_seed=init_seed,
            moe_factory=moe_factory,
            device=device,
            dtype=params_dtype,
            layer_range=stages[c * pp + parallel_state.coords.pp.rank],
        )
        for layer in chunk.transformer_layers():
            layer.recompute = recompute
        chunks.append(chunk)
    set_moe_overlap(chunks, overlap_moe_comm=overlap_moe_comm, delay_wgrad=delay_wgrad)
    return chunks


def set_moe_overlap(chunks: List[nn.Module], *, overlap_moe_comm: bool, delay_wgrad: bool) -> None:
    """Set every MoE layer of ``chunks`` to compute its shared expert during its own dispatch
    (``overlap_moe_comm``) and its experts' weight gradients behind the backward dispatch
    (``delay_wgrad``); the numbers do not change, only when the work runs."""
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                module.overlap_comm = overlap_moe_comm
                module.experts.delay_wgrad = delay_wgrad
