"""The MoE block factories: :class:`folding.moe.layer.MoELayer` configured from a model's preset or from
a job's :class:`~folding.moe.config.MoEConfig`.

:class:`~folding.model.block.TransformerLayer` calls ``moe_factory(config=, layer_number=, groups=,
init_seed=, device=, dtype=)`` for each MoE layer; any callable with that signature returning a
module ``[S/TP, B, H] -> [S/TP, B, H]`` can replace these. :func:`moe_config_from_model` maps the
architecture onto the router options (Mixtral: softmax after top-k; Qwen2-MoE: softmax before
top-k, renormalized iff ``norm_topk_prob``), dropless, per-micro-batch aux loss, no jitter.

Usage::

    model = MoETransformer(cfg, parallel_state=ps, moe_factory=default_moe_factory)
    model = MoETransformer(cfg, parallel_state=ps, moe_factory=moe_factory_for(job.moe))
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch import nn

from ..moe.config import MoEConfig
from ..moe.layer import MoELayer
from .config import ModelConfig
from .groups import ModelGroups


def moe_config_from_model(config: ModelConfig, **overrides) -> MoEConfig:
    """The :class:`MoEConfig` of ``config``'s MoE layers (``overrides`` replace fields)."""
    fields = {f.name for f in dataclasses.fields(MoEConfig)}
    pre_softmax = config.pre_softmax and not config.norm_topk_prob
    values = dict(
        num_experts=config.num_experts,
        topk=config.topk,
        ffn_hidden_size=config.moe_ffn_hidden_size,
        score_function=config.score_function,
        pre_softmax=pre_softmax,
        aux_loss_coeff=config.router_aux_loss_coef,
        capacity_factor=None,
        input_jitter_eps=None,
        shared_expert_ffn_hidden_size=config.shared_expert_ffn_hidden_size,
        shared_expert_gate=config.shared_expert_gate,
    )
    values.update(overrides)
    return MoEConfig(**{k: v for k, v in values.items() if k in fields})


def moe_factory_for(moe_config: Optional[MoEConfig] = None) -> Callable[..., nn.Module]:
    """A model ``moe_factory`` that builds :class:`MoELayer` blocks with ``moe_config`` (a job's: the
    preset's options with its ``moe.*`` overrides), or, when ``None``, with each model's own
    :func:`moe_config_from_model`.

    The layer creates its weights on ``device`` in ``dtype`` and initializes them from
    ``(init_seed, layer_number)`` (layout-independent), unless ``device`` is ``meta``.
    """

    def factory(
        *,
        config: ModelConfig,
        layer_number: int,
        groups: ModelGroups,
        init_seed: int = 0,
        device=None,
        dtype=torch.float32,
    ) -> nn.Module:
        moe = moe_config if moe_config is not None else moe_config_from_model(config)
        return MoELayer(
            config=moe,
            hidden_size=config.hidden_size,
            ep_group=groups.ep,
            etp_group=groups.etp,
            tp_cp_group=groups.tp_cp,
            tp_dp_cp_group=groups.tp_dp_cp,
            tp_group=groups.tp,
            layer_number=layer_number,
            init_seed=init_seed,
            init_std=config.init_std,
            params_dtype=dtype,
            device=device,
        )

    return factory


default_moe_factory = moe_factory_for()
"""The factory :class:`~folding.model.transformer.MoETransformer` uses when given none: the engine's
:class:`MoELayer` with the preset's MoE options."""
