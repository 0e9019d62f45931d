"""The MoE block factory: :class:`folding.moe.layer.MoELayer` built from a model's own MoE record.

:class:`~folding.model.block.TransformerLayer` calls, for each MoE layer::

    moe_factory(config=model_config, layer_number=i, groups=groups, settings=settings)

``settings`` is the model's :class:`~folding.moe.settings.LayerSettings` (parameter dtype and device,
init seed, ``overlap_comm``, ``delay_wgrad``, the resolved ``expert_backend``, ``recompute``); any
callable taking these keywords and returning a module ``[S/TP, B, H] -> [S/TP, B, H]`` can replace
:func:`default_moe_factory`. A factory must honour the settings or refuse them (raise); one whose
signature does not take ``settings`` is refused when the model is built
(:func:`check_moe_factory`), so no setting is lost on the way. Every MoE option is ``config.moe``
(:class:`~folding.moe.config.MoEConfig`): to change one, change the model's record
(``cfg.replace(moe={"capacity_factor": 1.0})``), never the factory.

Usage::

    model = MoETransformer(cfg, parallel_state=ps)                               # default_moe_factory
    model = MoETransformer(cfg.replace(moe={"dispatcher": "allgather"}), parallel_state=ps)
"""

from __future__ import annotations

import inspect
from typing import Callable

from torch import nn

from ..moe.layer import build_moe_layer
from ..moe.settings import LayerSettings
from ..parallel.groups import ProcessGroups
from .config import ModelConfig
from .recompute import recompute_mode

FACTORY_KEYWORDS = ("config", "layer_number", "groups", "settings")
"""The keyword arguments every MoE block factory is called with."""


def default_moe_factory(
    *, config: ModelConfig, layer_number: int, groups: ProcessGroups, settings: LayerSettings
) -> nn.Module:
    """The engine's MoE block: :func:`~folding.moe.layer.build_moe_layer` with ``config.moe`` on the
    model's expert groups, built with ``settings``.

    The layer creates its weights with their records and leaves their values to the model, which
    draws every parameter from ``(settings.init_seed, its name in the model)`` (layout-independent).
    ``settings.recompute`` (:mod:`folding.model.recompute`) gives its ``moe_act`` and ``shared_experts``
    modules; ``moe`` (the whole block) is the layer's to checkpoint.
    """
    rc = recompute_mode(settings.recompute)
    return build_moe_layer(
        config.moe,
        hidden_size=config.hidden_size,
        groups=groups,
        layer_number=layer_number,
        init_std=config.init_std,
        output_init_std=config.output_init_std,
        settings=settings.replace(init_seed=None),
        # inside a checkpointed block (moe) nothing is recomputed twice
        recompute_act=rc.has("moe_act") and not rc.has("moe"),
        recompute_shared_expert=rc.has("shared_experts") and not rc.has("moe"),
    )


def check_moe_factory(factory: Callable[..., nn.Module]) -> None:
    """Raise ``TypeError`` unless ``factory`` takes every keyword of :data:`FACTORY_KEYWORDS` (by name
    or through ``**kwargs``): a factory written for fewer arguments would build its blocks without the
    run's settings."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the call itself will say
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    missing = [k for k in FACTORY_KEYWORDS if k not in params or params[k].kind is inspect.Parameter.POSITIONAL_ONLY]
    if missing:
        raise TypeError(
            f"moe_factory {getattr(factory, '__qualname__', factory)!r} does not take the keyword(s) {missing}: "
            f"an MoE block factory is called as factory({', '.join(k + '=' for k in FACTORY_KEYWORDS)}) "
            "(folding.model.moe_block), settings being the run's folding.moe.settings.LayerSettings"
        )
