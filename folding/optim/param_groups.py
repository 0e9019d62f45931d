"""Which parameters get weight decay, and how each parameter's gradient is reduced.

Every trainable parameter falls in one :class:`ParamClass`, read from its tags
(:mod:`folding.parallel.params`), its dimensionality and its name; parameters of one class
share a gradient buffer, a reduction path and a weight-decay setting.

Weight decay (AdamW's decoupled decay) is applied to matrices only. It is *not* applied to

- any parameter with ``ndim <= 1``: norm scales, biases, the router's expert bias;
- any parameter whose last name component contains ``bias`` (e.g. stacked expert biases ``[E, F]``);
- any parameter whose name contains ``norm`` (e.g. a norm stored with an extra dimension).

Under ``optim.name=muon`` :func:`uses_muon` splits the parameters once more: Muon updates the 2-D
hidden weight matrices, AdamW everything else (their classes differ in :attr:`ParamClass.muon`, so
they never share a gradient buffer).

Usage::

    cls = classify(name, param, muon=uses_muon(name, param))
    cls.expert, cls.decay, cls.muon
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
    muon: bool = False
    """Updated by Muon (``optim.name=muon`` and :func:`uses_muon`); AdamW otherwise."""

    def describe(self) -> str:
        """Short human-readable name, e.g. ``expert/tp_sharded/decay/float32``."""
        parts = [
            "expert" if self.expert else "dense",
            "tp_sharded" if self.tp_sharded else ("sequence_parallel" if self.sequence_parallel else "tp_replicated"),
        ]
        if self.embedding_tied:
            parts.append("embedding_tied")
        parts += ["decay" if self.decay else "no_decay", self.dtype]
        if self.muon:
            parts.append("muon")
        return "/".join(parts)


def uses_weight_decay(name: str, param: torch.Tensor) -> bool:
    """True when AdamW weight decay applies to ``param`` named ``name`` (see the module docstring)."""
    leaf = name.rsplit(".", 1)[-1].lower()
    if param.dim() <= 1 or "bias" in leaf or "norm" in name.lower():
        return False
    return True


MUON_EXCLUDED = ("embedding", "output_weight", "router", "gate_weight")
"""Name components (substrings of one dot-separated component) of 2-D weights that stay on AdamW:
word embeddings (the MTP module's copy included), the output layer, the router, the shared expert's
scalar gate."""


def uses_muon(name: str, param: torch.Tensor) -> bool:
    """True when Muon updates ``param`` named ``name`` under ``optim.name=muon``: the hidden weight
    matrices, i.e. attention projections (MLA's down/up projections included), dense MLP, shared
    expert, MTP's projection, and the routed experts' ``fc1``/``fc2`` (orthogonalized per expert, and
    fc1's gate and up halves as two matrices: the parameter record's full shape ends in the matrix
    ``[rows, cols]``, every leading dimension indexes separate matrices).

    AdamW keeps (as the published Muon recipes do): anything whose full shape is not at least 2-D or
    has a dimension of 1, biases and norms (:func:`uses_weight_decay` is false), and the weights named
    in :data:`MUON_EXCLUDED` (embedding, output layer, router, shared-expert gate)."""
    full = param_spec(param).full_shape or tuple(param.shape)
    if len(full) < 2 or min(full[-2:]) <= 1 or not uses_weight_decay(name, param):
        return False
    parts = name.lower().split(".")
    return not any(key in part for part in parts for key in MUON_EXCLUDED)


def classify(name: str, param: torch.Tensor, *, muon: bool = False) -> ParamClass:
    """The :class:`ParamClass` of ``param`` (named ``name`` in its module) from its tags; ``muon``:
    Muon updates it (:func:`uses_muon` under ``optim.name=muon``)."""
    t = param_spec(param)
    return ParamClass(
        expert=t.expert,
        tp_sharded=t.tp_sharded,
        sequence_parallel=t.sequence_parallel,
        embedding_tied=t.embedding_tied,
        decay=uses_weight_decay(name, param),
        dtype=str(param.dtype).replace("torch.", ""),
        muon=muon,
    )
