"""This rank's model chunks for training: the model cut into ``pp·vpp`` virtual pipeline stages.

Chunk ``c`` of pipeline rank ``r`` is virtual stage ``c·pp + r`` (:mod:`folding.parallel.partition`).
Each chunk is a :class:`~folding.model.transformer.MoETransformer` restricted to its layer range
(parameter names keep the global layer index, so checkpoints do not depend on the cut, and it may
hold no layer at all under ``parallel.pipeline_layout``); the first
virtual stage holds the embedding, the last one the final norm and output layer (and, with tied
embeddings, its own copy of the table, whose gradient is summed with the first stage's over the
embedding group; with multi-token prediction, also the MTP modules and a copy of the table).
:func:`folding.pipeline.stage.run_microbatches` runs a step through them, inside the chunks' own
per-step duties (:func:`step_scope`: what the model needs done around one optimizer step's schedule,
so that the schedule knows no MoE layer).

Usage::

    settings = LayerSettings(init_seed=job.train.seed, recompute=job.train.recompute_setting())
    chunks = build_stage_chunks(model_config=job.model, parallel_state=ps, settings=settings)
    with step_scope(chunks):
        run_the_schedule()
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Sequence

from torch import nn

from ..moe.layer import MoELayer
from ..moe.replicas.fetch import replica_step
from ..moe.settings import LayerSettings
from ..parallel.partition import layout_stages
from .config import ModelConfig
from .recompute import recompute_mode
from .transformer import MoETransformer


def build_stage_chunks(
    *,
    model_config: ModelConfig,
    parallel_state,
    settings: LayerSettings = LayerSettings(),
    moe_factory: Optional[Callable[..., nn.Module]] = None,
) -> List[nn.Module]:
    """The chunks (one per virtual stage this rank holds, in chunk order), initialized identically
    whatever the layout. Every chunk is built with ``settings``
    (:class:`~folding.moe.settings.LayerSettings`: dtype, device, init seed, ``recompute``, the MoE
    layers' ``overlap_comm`` and ``delay_wgrad``, the expert backend, resolved once for all chunks when
    not given). The MoE blocks follow ``model_config.moe``; ``moe_factory`` (default:
    :func:`folding.model.moe_block.default_moe_factory`) replaces the MoE block entirely and receives
    the same settings (:mod:`folding.model.moe_block`)."""
    recompute_mode(settings.recompute)  # a bad mode fails here, before any chunk is built
    settings = settings.with_expert_backend(model_config.moe)
    layout = parallel_state.layout
    pp, vpp = layout.pp, layout.virtual_stages
    stages = layout_stages(layout, num_layers=model_config.num_layers, mtp_num_layers=model_config.mtp_num_layers)
    rank, V = parallel_state.coords.pp.rank, len(stages)
    return [
        MoETransformer(
            model_config,
            parallel_state=parallel_state,
            settings=settings,
            moe_factory=moe_factory,
            layer_range=stages[c * pp + rank],
            pre_process=c * pp + rank == 0,
            post_process=c * pp + rank == V - 1,
        )
        for c in range(vpp)
    ]


def step_scope(chunks: Sequence[nn.Module], *, training: bool = True) -> contextlib.AbstractContextManager:
    """The per-step duties of ``chunks`` (this rank's, in chunk order), as a context manager entered around
    one optimizer step's schedule: with ``training``, the MoE layers with replica slots fetch their
    replicas' weights once for the step and return the replicas' gradients to the owners when it ends
    (:func:`folding.moe.replicas.fetch.replica_step`: one EP exchange each way per layer, in chunk and
    module order, the same on every rank of a stage); evaluation (``training=False``) has none."""
    layers = [m for c in chunks for m in c.modules() if isinstance(m, MoELayer) and m.num_replicas] if training else []
    return replica_step([(m.replica_weights, m.replica_owners()) for m in layers])
