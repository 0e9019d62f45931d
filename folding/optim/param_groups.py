"""Which parameters get weight decay, and how each parameter's gradient is reduced.

Every trainable parameter falls in one :class:`ParamClass`, read from its tags
(:mod:`folding.parallel.params`), its dimensionality and its name; parameters of one class
share a gradient buffer, a reduction path and a weight-decay setting.

Weight decay (AdamW's decoupled decay) is applied to matrices only. It is *not* applied to

- any parameter with ``ndim <= 1``: norm scales, biases, the router's expert bias;
- any parameter whose last name component contains ``bias`` (e.g. stacked expert biases ``[E, F]``);
- any parameter whose name contains ``norm`` (e.g. a norm stored with an extra dimension).

Usage::

    cls = classify(name, param)
    cls.expert, cls.decay
"""

from __future__ import annotations

import dataclasses

import torch

from folding.parallel.params import param_spec


@dataclasses.dataclass(frozen=True, order=True)
class ParamClass:
    """The reduction and decay class of a parameter (one gradient buffer per class and dtype)."""

    expert: bool
    """Expert parameter: gradients sum over EDP, state shards over EDP."""
    tp_sharded: bool
    """Sharded over the view's TP group (TP, or ETP for experts): every shard counts in the norm."""
    sequence_parallel: bool
    """Replicated over TP with partial gradients: gradients also sum over TP (ETP for experts)."""
    embedding_tied: bool
    """Tied across the first and last pipeline stage: gradients also sum over the embedding group."""
    decay: bool
    """AdamW weight decay applies."""
    dtype: str
    """Parameter dtype name (``float32``, ``bfloat16``...)."""

    def describe(self) -> str:
        """Short human-readable name, e.g. ``expert/tp_sharded/decay/float32``."""
        parts = [
            "expert" if self.expert else "dense",
            "tp_sharded" if self.tp_sharded else ("sequence_parallel" if self.sequence_parallel else "tp_replicated"),
        ]
        if self.embedding_tied:
            parts.append("embedding_tied")
        parts += ["decay" if self.decay else "no_decay", self.dtype]
        return "/".join(parts)


def uses_weight_decay(name: str, param: torch.Tensor) -> bool:
    """True when AdamW weight decay applies to ``param`` named ``name`` (see the module docstring)."""
    leaf = name.rsplit(".", 1)[-1].lower()
    if param.dim() <= 1 or "bias" in leaf or "norm" in name.lower():
        return False
    return True


def classify(name: str, param: torch.Tensor) -> ParamClass:
    """The :class:`ParamClass` of ``param`` (named ``name`` in its module) from its tags."""
    t = param_spec(param)
    return ParamClass(
        expert=t.expert,
        tp_sharded=t.tp_sharded,
        sequence_parallel=t.sequence_parallel,
        embedding_tied=t.embedding_tied,
        decay=uses_weight_decay(name, param),
        dtype=str(param.dtype).replace("torch.", ""),
    )
