"""The MoE block factory: :class:`folding.moe.layer.MoELayer` built from a model's own MoE record.

:class:`~folding.model.block.TransformerLayer` calls ``moe_factory(config=, layer_number=, groups=,
init_seed=, device=, dtype=)`` for each MoE layer; any callable with that signature returning a
module ``[S/TP, B, H] -> [S/TP, B, H]`` can replace :func:`default_moe_factory`. Every MoE option is
``config.moe`` (:class:`~folding.moe.config.MoEConfig`): to change one, change the model's record
(``cfg.replace(moe={"capacity_factor": 1.0})``), never the factory.

Usage::

    model = MoETransformer(cfg, parallel_state=ps)                               # default_moe_factory
    model = MoETransformer(cfg.replace(moe={"dispatcher": "allgather"}), parallel_state=ps)
"""

from __future__ import annotations

import torch
from torch import nn

from ..moe.layer import MoELayer
from ..parallel.groups import ProcessGroups
from .config import ModelConfig


def default_moe_factory(
    *,
    config: ModelConfig,
    layer_number: int,
    groups: ProcessGroups,
    init_seed: int = 0,
    device=None,
    dtype=torch.float32,
) -> nn.Module:
    """The engine's MoE block: :class:`MoELayer` with ``config.moe`` on the model's expert groups.

    The layer creates its weights on ``device`` in ``dtype`` with their records and leaves their
    values to the model, which draws every parameter from ``(init_seed, its name in the model)``
    (layout-independent); ``init_seed`` is part of the factory signature for factories that
    initialize on their own.
    """
    return MoELayer(
        config=config.moe,
        hidden_size=config.hidden_size,
        groups=groups,
        layer_number=layer_number,
        init_seed=None,
        init_std=config.init_std,
        output_init_std=config.output_init_std,
        params_dtype=dtype,
        device=device,
    )
