"""Decoder-only MoE transformers (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): presets, the parallel model, HF checkpoints.

Usage::

    from folding.model import MoETransformer, get_preset, from_hf
    model = MoETransformer(get_preset("mixtral_tiny"), parallel_state=ps, settings=LayerSettings(init_seed=0))
"""

from .config import ModelConfig
from .hf.weights import from_hf, to_hf
from .presets import get_preset, list_presets
from .transformer import MoETransformer

__all__ = ["ModelConfig", "MoETransformer", "from_hf", "get_preset", "list_presets", "to_hf"]
