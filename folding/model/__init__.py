"""Decoder-only MoE transformers (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): presets, the parallel model, HF checkpoints.

Usage::

    from folding.model import MoETransformer, get_preset, from_hf
    model = MoETransformer(get_preset("mixtral_tiny"), parallel_state=ps, settings=LayerSettings(init_seed=0))
"""

import importlib

_EXPORTS = {
    "ModelConfig": "config",
    "MoETransformer": "transformer",
    "from_hf": "hf.weights",
    "to_hf": "hf.weights",
    "get_preset": "presets",
    "list_presets": "presets",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """The package's names, each imported from its module on first use: the configurations and presets
    import no torch, so the planner and the tools that only read them start without it."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
