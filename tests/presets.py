"""Shrunken model presets shared by the multi-rank model tests: the ``*_tiny`` presets cut to hidden 32,
expert FFN 16 and vocabulary 256, which a pool of CPU ranks runs in every test layout in seconds.

Each is a keyword dict (``name`` and the overrides of :func:`folding.model.presets.get_preset`), which
travels to the ranks as is; :func:`variant` adds overrides, :func:`build` makes the config, and
:func:`random_batch` a batch for them.

Usage::

    CONFIGS = [variant(MIXTRAL, num_layers=2), variant(QWEN2_TIED, moe=dict(aux_loss_coeff=0.0))]
    cfg = build(CONFIGS[0])                      # on a rank
    ids, labels, mask = random_batch(4, 16, seed=5, masked=0.25)
"""

from typing import Any, Dict, Optional, Tuple

import torch

from folding.model.config import ModelConfig
from folding.model.presets import get_preset

SHRUNK = dict(hidden_size=32, moe=dict(ffn_hidden_size=16), vocab_size=256, init_std=0.1)
"""The overrides every shrunken preset has (initial std 0.1: routing and attention are not trivial)."""


def variant(preset: Dict[str, Any], *, moe: Optional[Dict[str, Any]] = None, **overrides) -> Dict[str, Any]:
    """``preset`` with more ``overrides``; ``moe`` entries are added to its ``moe`` overrides."""
    return {**preset, **overrides, "moe": {**preset.get("moe", {}), **(moe or {})}}


def build(preset: Dict[str, Any]) -> ModelConfig:
    """The validated model config of a keyword dict of this module."""
    kw = dict(preset)
    return get_preset(kw.pop("name"), **kw)


def random_batch(
    batch: int, seq: int, *, seed: int, masked: float, vocab_size: int = 256
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, labels, loss_mask)``, each ``[batch, seq]``: random tokens and labels below
    ``vocab_size`` and a float mask that drops each position with probability ``masked``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
    labels = torch.randint(0, vocab_size, (batch, seq), generator=g)
    mask = (torch.rand(batch, seq, generator=g) > masked).float()
    return ids, labels, mask


MIXTRAL = variant(dict(name="mixtral_tiny", **SHRUNK))
"""Mixtral: every layer MoE, untied embeddings."""
QWEN2_TIED = variant(
    dict(name="qwen2_moe_tiny", **SHRUNK),
    moe=dict(shared_expert_ffn_hidden_size=16),
    mlp_only_layers=(0,),
    ffn_hidden_size=32,
    tie_embeddings=True,
)
"""Qwen2-MoE with a gated shared expert, a dense first layer and tied embeddings."""
QWEN3 = variant(dict(name="qwen3_moe_tiny", **SHRUNK), mlp_only_layers=(0,), ffn_hidden_size=32)
"""Qwen3-MoE: per-head q/k norm, head_dim 16 != hidden/heads; a dense first layer."""
OLMOE = variant(dict(name="olmoe_tiny", **SHRUNK))
"""OLMoE: q/k norm over the whole projection (TP-sharded weights, sum of squares all-reduced over TP)."""
