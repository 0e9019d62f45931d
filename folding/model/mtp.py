"""Multi-token prediction (DeepSeek-V3): D modules after the last layer, module k predicting the token
k+1 positions ahead.

Module k (k = 1..D) combines, at every position i, the hidden state ``h_{k-1}`` of position i (the
final-normed decoder output for k = 1, module k-1's output after) with the embedding of the token at
position i+k, runs one transformer layer and normalizes::

    x   = eh_proj([enorm(Emb(t_{i+k})); hnorm(h_{k-1, i})])        # [2H] -> [H]
    h_k = head_norm(layer_k(x))                                    # the model's output layer reads h_k

and its loss is the cross-entropy of the model's output layer on ``h_k`` against the label of position
i+k (the token i+k+1), masked by the loss mask of position i+k and zero past the sequence end.
Embedding and output layer are the model's (shared); ``layer_k`` is an ordinary
:class:`~folding.model.block.TransformerLayer` with layer number ``num_layers + k - 1`` (MLA and MoE
for DeepSeek-V3), the same RoPE positions as the decoder.

Parallelism: the modules run on the last pipeline stage, on the sequence-parallel shard
``[S/(CP·TP), B, H]``. ``eh_proj`` is replicated over TP and applied to each rank's own tokens (no
communication; its gradient, like the norms', is TP-partial and summed over TP by the gradient
reducer). Shifting by k needs no communication under CP: every CP rank holds the micro-batch's full
ids, labels and mask ``[B, S]`` and reads them at its own positions plus k
(:func:`shift_left`). Hugging Face names (``model.layers.{num_hidden_layers + k - 1}.*``): ``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm`` (``head_norm``), the layer's own tensors, and copies of
the embedding (``embed_tokens``) and output layer (``shared_head.head``).

Usage::

    mtp = MTPModule(config, depth=1, groups=groups, moe_factory=default_moe_factory)
    h1_SBH = mtp(h0_SBH, model.embed(shift_left(ids_BS, 1, 0)), rope)
"""

from __future__ import annotations

import torch
from torch import nn

from ..moe.settings import LayerSettings
from ..parallel.groups import ProcessGroups
from ..parallel.params import mark_param, set_init_spec
from .block import MoEFactory, TransformerLayer
from .config import ModelConfig
from .norm import RMSNorm


def shift_left(t_BS: torch.Tensor, k: int, fill) -> torch.Tensor:
    """``t`` moved ``k`` positions to the left along the sequence: ``out[:, i] = t[:, i + k]``, and
    ``fill`` for the last ``k`` positions (``[B, S]`` in, ``[B, S]`` out)."""
    if k == 0:
        return t_BS
    B, S = t_BS.shape
    k = min(k, S)
    return torch.cat([t_BS[:, k:], t_BS.new_full((B, k), fill)], dim=1)


class MTPModule(nn.Module):
    """One multi-token-prediction module (module docstring): ``(h_{k-1}, Emb(t_{i+k})) -> h_k``, all
    ``[S/(CP·TP), B, H]``."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        depth: int,
        groups: ProcessGroups,
        moe_factory: MoEFactory,
        settings: LayerSettings = LayerSettings(),
        offloader=None,
    ):
        super().__init__()
        if not 1 <= depth <= config.mtp_num_layers:
            raise ValueError(f"MTP depth {depth} is outside 1..model.mtp_num_layers={config.mtp_num_layers}")
        H, kw = config.hidden_size, dict(device=settings.device, dtype=settings.params_dtype)
        self.depth = depth
        self.enorm = RMSNorm(H, eps=config.norm_eps, **kw)
        self.hnorm = RMSNorm(H, eps=config.norm_eps, **kw)
        self.eh_proj = nn.Linear(2 * H, H, bias=False, **kw)
        # replicated over TP, fed by sequence-sharded rows: TP-partial gradient, summed over TP
        mark_param(self.eh_proj.weight, sequence_parallel=True)
        set_init_spec(self.eh_proj.weight, full_shape=(H, 2 * H), std=config.init_std)
        self.layer = TransformerLayer(
            config,
            layer_number=config.num_layers + depth - 1,
            groups=groups,
            moe_factory=moe_factory,
            settings=settings,
            offloader=offloader,
        )
        self.head_norm = RMSNorm(H, eps=config.norm_eps, **kw)

    def forward(self, h_SBH: torch.Tensor, emb_SBH: torch.Tensor, rope, dropout=None) -> torch.Tensor:
        """``h_SBH``: the previous depth's hidden states; ``emb_SBH``: the embedding of the tokens
        ``depth`` positions ahead, both this rank's shard; ``rope`` and ``dropout`` (the micro-batch's
        :class:`~folding.model.dropout.DropoutKeys` or ``None``) as for the decoder's layers."""
        x_SBH = self.eh_proj(torch.cat([self.enorm(emb_SBH), self.hnorm(h_SBH)], dim=-1))
        return self.head_norm(self.layer(x_SBH, rope, dropout))
