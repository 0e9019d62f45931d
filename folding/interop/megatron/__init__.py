"""Everything that speaks Megatron: its command-line flags as this engine's Hydra overrides, and the
engine's token dispatchers inside Megatron-Core's ``MoELayer``.

- :mod:`.args`, :mod:`.flags`, :mod:`.specials`: the argument translator and its tables
  (``python -m tools.megatron_args``).
- :mod:`.replace`: :func:`replace_dispatcher`, one call that swaps a Megatron-Core layer's dispatcher.
- :mod:`.stages`: :class:`MegatronDispatcher`, Megatron-Core's six-stage interface (and its
  shared-expert, CUDA-graph and inference hooks) as an adapter over an engine dispatcher.

Usage::

    from folding.interop.megatron import replace_dispatcher
    replace_dispatcher(layer)   # layer: a Megatron-Core MoELayer
"""

from .args import MegatronArgsError, convert
from .replace import replace_dispatcher

__all__ = ["MegatronArgsError", "convert", "replace_dispatcher"]
