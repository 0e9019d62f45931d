"""Hugging Face checkpoints: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3 in any layout.

- :mod:`.weights`: load and save weights (:func:`from_hf`, :func:`to_hf`).
- :mod:`.config`, :mod:`.deepseek`: ``config.json`` to :class:`~folding.model.config.ModelConfig` and back.
- :mod:`.names`: which Hugging Face tensors make up each engine parameter; :mod:`.errors`: the error.
"""

from .weights import from_hf, to_hf

__all__ = ["from_hf", "to_hf"]
