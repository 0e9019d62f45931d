"""One transformer layer: pre-norm attention and pre-norm MLP (dense SwiGLU or an MoE block).

``x + attn(norm1(x))`` then ``h + mlp(norm2(h))`` on sequence-parallel shards ``[S_cp/TP, B, H]``.
The MoE block is built by a *factory* so that the layer does not depend on one MoE
implementation: ``moe_factory(config=..., layer_number=..., groups=..., init_seed=..., device=...,
dtype=...)`` must return a module mapping ``[S_cp/TP, B, H]`` to the same shape (the local tokens of
this attention rank). :func:`folding.model.moe_block.default_moe_factory` builds
:class:`folding.moe.layer.MoELayer`.

Activation recompute (``recompute``): ``none``; ``full`` keeps only the layer input and recomputes
the whole layer in backward; ``selective`` recomputes the attention block (projections, core and
its TP/CP communication); ``moe`` recomputes the MoE block (router, dispatch, experts, combine).
Recompute uses non-reentrant ``torch.utils.checkpoint``; every rank recomputes in the same order, so
the collectives inside a recomputed region match. A recomputed router runs its statistics twice
(expert-bias counts double, which leaves the sign-based bias update unchanged).

Usage::

    layer = TransformerLayer(config, layer_number=3, groups=groups, moe_factory=default_moe_factory)
    layer.recompute = "full"
    x_SBH = layer(x_SBH, rope)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..parallel.groups import ProcessGroups
from .attention import Attention
from .config import ModelConfig
from .mla import MLAttention
from .mlp import DenseMLP
from .norm import RMSNorm

MoEFactory = Callable[..., nn.Module]
RECOMPUTE_MODES = ("none", "full", "selective", "moe")


class TransformerLayer(nn.Module):
    """Pre-norm decoder layer; ``mlp`` is a :class:`DenseMLP` or the factory's MoE block."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        layer_number: int,
        groups: ProcessGroups,
        moe_factory: MoEFactory,
        init_seed: int = 0,
        device=None,
        dtype=torch.float32,
    ):
        super().__init__()
        self.layer_number = layer_number
        self.recompute = "none"
        """Activation recompute mode, one of :data:`RECOMPUTE_MODES` (see the module docstring)."""
        self.is_moe = config.is_moe_layer(layer_number)
        kw = dict(device=device, dtype=dtype)
        self.input_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, **kw)
        attention_cls = Attention if config.mla is None else MLAttention  # MLA: DeepSeek-V3
        self.attention = attention_cls(
            config, tp_group=groups.tp, cp_group=groups.cp, output_init_std=config.output_init_std, **kw
        )
        self.post_attention_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, **kw)
        if self.is_moe:
            self.mlp = moe_factory(config=config, layer_number=layer_number, groups=groups, init_seed=init_seed, **kw)
        else:
            self.mlp = DenseMLP(
                config.hidden_size,
                config.ffn_hidden_size,
                tp_group=groups.tp,
                init_std=config.init_std,
                output_init_std=config.output_init_std,
                **kw,
            )

    def forward(self, x_SBH: torch.Tensor, rope) -> torch.Tensor:
        """``[S_cp/TP, B, H] -> [S_cp/TP, B, H]``; ``rope = (cos, sin, kv_order, chunk_starts)`` from
        :meth:`MoETransformer.rope`."""
        mode = self.recompute if torch.is_grad_enabled() else "none"
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"train.recompute={mode!r}: choose one of {RECOMPUTE_MODES}")
        if mode == "full":
            return checkpoint(self._forward, x_SBH, rope, "none", use_reentrant=False)
        return self._forward(x_SBH, rope, mode)

    def _attention(self, x_SBH, rope):
        return self.attention(self.input_norm(x_SBH), *rope)

    def _mlp(self, h_SBH):
        return self.mlp(self.post_attention_norm(h_SBH))

    def _forward(self, x_SBH, rope, mode):
        if mode == "selective":
            h = x_SBH + checkpoint(self._attention, x_SBH, rope, use_reentrant=False)
        else:
            h = x_SBH + self._attention(x_SBH, rope)
        if mode == "moe" and self.is_moe:
            return h + checkpoint(self._mlp, h, use_reentrant=False)
        return h + self._mlp(h)
