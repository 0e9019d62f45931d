"""How a parameter is parallelized: the tags that gradient reduction, clipping and checkpoints read.

Modules tag their parameters when they create them; the optimizer side reads the tags and never
guesses from names. A parameter without tags is a dense parameter replicated over TP.

- ``expert``: an expert weight (sharded over EP, and over ETP if ``tp_sharded``); its gradient is
  reduced over EDP, not over DP×CP.
- ``tp_sharded``: sharded over the tensor-parallel group of its view (attention TP for dense
  parameters, ETP for expert parameters) along ``tp_dim``; every shard counts in the grad norm.
- ``sequence_parallel``: replicated over attention TP but fed by sequence-sharded activations
  (norms, the router, biases after a row-parallel linear under SP): every TP rank holds a partial
  gradient that must be summed over TP.
- ``embedding_tied``: the word embedding or output weight tied across the first and last pipeline
  stage: gradients are summed over the embedding group.

Usage::

    mark_param(self.weight, tp_sharded=True, tp_dim=0)
    mark_param(self.fc1_weight, expert=True, tp_sharded=True, tp_dim=1)
    param_tags(p).expert
"""

from __future__ import annotations

import dataclasses

import torch

_ATTR = "_folding_tags"


@dataclasses.dataclass(frozen=True)
class ParamTags:
    """The parallel nature of one parameter (see the module docstring)."""

    expert: bool = False
    """Expert parameter: reduce gradients over EDP."""
    tp_sharded: bool = False
    """Sharded over the view's TP group (TP for dense, ETP for expert)."""
    tp_dim: int = -1
    """Dimension along which it is sharded, when ``tp_sharded``."""
    sequence_parallel: bool = False
    """Replicated over TP with partial gradients under sequence parallelism (sum over TP)."""
    embedding_tied: bool = False
    """Tied between the first and last pipeline stages (sum over the embedding group)."""


def mark_param(p: torch.nn.Parameter, **tags) -> torch.nn.Parameter:
    """Attach :class:`ParamTags` to ``p`` (keyword arguments are its fields) and return ``p``."""
    t = ParamTags(**tags)
    if t.sequence_parallel and t.tp_sharded:
        raise ValueError("a parameter cannot be both tp_sharded and sequence_parallel")
    setattr(p, _ATTR, t)
    return p


def param_tags(p: torch.Tensor) -> ParamTags:
    """The tags of ``p`` (defaults for an untagged dense replicated parameter)."""
    return getattr(p, _ATTR, ParamTags())
