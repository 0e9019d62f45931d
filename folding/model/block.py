"""One transformer layer: pre-norm attention and pre-norm MLP (dense SwiGLU or an MoE block).

``x + attn(norm1(x))`` then ``h + mlp(norm2(h))`` on sequence-parallel shards ``[S_cp/TP, B, H]``.
The MoE block is built by a *factory* so that the layer does not depend on one MoE
implementation: ``moe_factory(config=..., layer_number=..., groups=..., settings=...)`` must return a
module mapping ``[S_cp/TP, B, H]`` to the same shape (the local tokens of this attention rank);
:mod:`folding.model.moe_block` documents the contract, and its
:func:`~folding.model.moe_block.default_moe_factory` builds :class:`folding.moe.layer.MoELayer`.

Everything about how the layer is built and run comes at construction in one
:class:`~folding.moe.settings.LayerSettings` (dtype, device, init seed, recompute, the MoE block's
overlap settings and expert backend); nothing is set on a built layer.

Activation recompute (``settings.recompute``: ``train.recompute`` and ``train.recompute_modules``): the
table of :mod:`folding.model.recompute`. ``full`` checkpoints the whole layer (only its input is kept);
otherwise each module recomputes its own part: ``layernorm`` discards both norms' outputs (refilled from
their kept inputs when backward reaches their consumers), ``mlp`` / ``moe`` checkpoint the dense MLP /
MoE block (its input, the post-attention norm's output, is kept), and the attention and MoE modules
apply ``core_attn``, ``mla_up_proj``, ``moe_act`` and ``shared_experts`` themselves. Checkpoints are
non-reentrant ``torch.utils.checkpoint``; every rank recomputes in the same order, so the collectives
inside a recomputed region match. A recomputed router runs its statistics twice (expert-bias counts
double, which leaves the sign-based bias update unchanged).

Usage::

    layer = TransformerLayer(config, layer_number=3, groups=groups, moe_factory=default_moe_factory,
                             settings=LayerSettings(recompute="full"))
    x_SBH = layer(x_SBH, rope)
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..memory.discard import discard_until_backward
from ..memory.offload import Offloader, offload_region
from ..moe.settings import LayerSettings
from ..overlap.runtime import recompute_contexts
from ..parallel.groups import ProcessGroups
from .attention import Attention
from .compile import dense_sublayer
from .config import ModelConfig
from .dropout import DropoutKeys, hidden_dropout
from .mla import MLAttention
from .mlp import DenseMLP
from .norm import RMSNorm
from .recompute import recompute_mode

MoEFactory = Callable[..., nn.Module]


class TransformerLayer(nn.Module):
    """Pre-norm decoder layer; ``mlp`` is a :class:`DenseMLP` or the factory's MoE block."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        layer_number: int,
        groups: ProcessGroups,
        moe_factory: MoEFactory,
        settings: LayerSettings = LayerSettings(),
        offloader: Optional[Offloader] = None,
    ):
        super().__init__()
        self.offloader = offloader
        """The model chunk's :class:`~folding.memory.offload.Offloader` (``train.offload_modules``), whose
        regions this layer's forward opens; ``None``: nothing is offloaded."""
        self.layer_number = layer_number
        self.recompute = recompute_mode(settings.recompute)
        """What this layer recomputes in backward (:mod:`folding.model.recompute`)."""
        self.discard_norms = self.recompute.has("layernorm") and not self.recompute.whole_layer
        """``layernorm``: both norms' outputs are freed once their consumers have run forward and
        recomputed from the inputs the norms keep when backward reaches the consumers
        (:mod:`folding.memory.discard`)."""
        self.dense_compiled = settings.compile_dense
        """Whether the input norm and attention sublayer run through ``torch.compile`` (a construction
        setting, ``train.compile``)."""
        self._dense = dense_sublayer(self._attention, compiled=settings.compile_dense)
        self.is_moe = config.is_moe_layer(layer_number)
        kw = dict(device=settings.device, dtype=settings.params_dtype)
        self.input_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, **kw)
        attention_cls = Attention if config.mla is None else MLAttention  # MLA: DeepSeek-V3
        # the compiled attention sublayer keeps autograd's own linear backward (a deferral inside a
        # compiled graph would break it)
        delay = settings.delay_wgrad and not settings.compile_dense
        recompute = dict(recompute_core=self.recompute.has("core_attn"))
        if config.mla is not None:
            recompute["recompute_up_proj"] = self.recompute.has("mla_up_proj")
        self.attention = attention_cls(
            config,
            tp_group=groups.tp,
            cp_group=groups.cp,
            output_init_std=config.output_init_std,
            delay_wgrad=delay,
            **recompute,
            **kw,
        )
        self.post_attention_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, **kw)
        if self.is_moe:
            self.mlp = moe_factory(config=config, layer_number=layer_number, groups=groups, settings=settings)
        else:
            self.mlp = DenseMLP(
                config.hidden_size,
                config.ffn_hidden_size,
                tp_group=groups.tp,
                init_std=config.init_std,
                output_init_std=config.output_init_std,
                delay_wgrad=settings.delay_wgrad,
                **kw,
            )

    def forward(self, x_SBH: torch.Tensor, rope, dropout: Optional[DropoutKeys] = None) -> torch.Tensor:
        """``[S_cp/TP, B, H] -> [S_cp/TP, B, H]``; ``rope = (cos, sin, kv_order, chunk_starts)`` from
        :meth:`MoETransformer.rope`; ``dropout``: the micro-batch's keys
        (:meth:`MoETransformer.dropout_keys`), ``None`` for none."""
        drop = dropout.at_layer(self.layer_number) if dropout is not None else None
        if self.recompute.whole_layer and torch.is_grad_enabled():
            return checkpoint(
                self._forward, x_SBH, rope, False, drop, use_reentrant=False, context_fn=recompute_contexts
            )
        if self.offloader is None:
            return self._forward(x_SBH, rope, torch.is_grad_enabled(), drop)
        with self.offloader.layer() as finish:  # the layer's offload regions, and its prefetch one layer ahead
            return finish(self._forward(x_SBH, rope, torch.is_grad_enabled(), drop))

    def _attention(self, x_SBH, rope, drop=None):
        with offload_region("attn_norm"):
            n_SBH = self.input_norm(x_SBH)
        out = self.attention(n_SBH, *rope, dropout=drop)
        if self.discard_norms:  # layernorm: the norm's output comes back from its kept input in backward
            discard_until_backward([n_SBH], after=out, refill=lambda: [self.input_norm(x_SBH)])
        return out

    def _forward(self, x_SBH, rope, modules: bool, drop: Optional[DropoutKeys] = None):
        """The layer; ``modules``: apply the recompute modules (off inside a whole-layer checkpoint and
        without autograd); ``drop``: the dropout keys bound to this layer (Megatron-LM's placement: the
        attention and MLP outputs, before each residual add)."""
        h = x_SBH + hidden_dropout(self._dense(x_SBH, rope, drop), drop, "attention_out")
        with offload_region("mlp_norm"):
            n_SBH = self.post_attention_norm(h)
        if modules and self.recompute.mlp(moe_layer=self.is_moe):  # moe / mlp: the block checkpointed
            out = checkpoint(self.mlp, n_SBH, use_reentrant=False, context_fn=recompute_contexts)
        else:
            out = self.mlp(n_SBH)
        if modules and self.discard_norms:
            discard_until_backward([n_SBH], after=out, refill=lambda: [self.post_attention_norm(h)])
        return h + hidden_dropout(out, drop, "mlp_out")
