"""What each activation-recompute mode (``train.recompute``) recomputes: the one table.

A transformer layer has two sublayers: attention (input norm, attention and its TP/CP communication)
and the MLP (post-attention norm and a dense SwiGLU, or the MoE block: router, dispatch, experts,
combine, shared expert). A mode names the sublayers whose forward runs again in backward:

=============  ===========  ============  ==============  ============
mode           attention    MoE block     dense MLP       whole layer
=============  ===========  ============  ==============  ============
``none``       no           no            no              no
``selective``  yes          no            no              no
``moe``        no           yes           no              no
``full``       yes          yes           yes             yes
=============  ===========  ============  ==============  ============

``whole_layer`` keeps only the layer's input (one checkpoint around the layer); otherwise each
sublayer marked is checkpointed on its own. Three readers, one table: the model
(:class:`folding.model.block.TransformerLayer` checkpoints what it says), the memory model
(:mod:`folding.planning.activations`: what a layer keeps and re-materializes) and the time models
(:mod:`folding.planning.step_time`, :mod:`folding.planning.flops`: the forwards run twice).

Usage::

    mode = recompute_mode("moe")
    mode.mlp(moe_layer=True)    # True: the MoE block runs its forward again in backward
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Recompute:
    """What one recompute mode runs again in backward (the module docstring's table)."""

    name: str
    """The mode's name (``train.recompute``)."""
    attention: bool
    """The attention sublayer (input norm + attention) is recomputed."""
    moe_block: bool
    """The MoE block of an MoE layer (post-attention norm + router + dispatch + experts + shared expert)."""
    dense_mlp: bool
    """The dense MLP of a dense layer (post-attention norm + SwiGLU)."""
    whole_layer: bool
    """Only the layer's input is kept: the whole layer is one recomputed region."""

    def mlp(self, *, moe_layer: bool) -> bool:
        """Whether the MLP sublayer of an MoE (``moe_layer``) or dense layer is recomputed."""
        return self.moe_block if moe_layer else self.dense_mlp


RECOMPUTE = {
    m.name: m
    for m in (
        Recompute("none", attention=False, moe_block=False, dense_mlp=False, whole_layer=False),
        Recompute("selective", attention=True, moe_block=False, dense_mlp=False, whole_layer=False),
        Recompute("moe", attention=False, moe_block=True, dense_mlp=False, whole_layer=False),
        Recompute("full", attention=True, moe_block=True, dense_mlp=True, whole_layer=True),
    )
}
"""Every recompute mode by name, from the least recomputed to the most."""

RECOMPUTE_MODES = tuple(RECOMPUTE)
"""The names ``train.recompute`` accepts."""


def recompute_mode(name: str) -> Recompute:
    """The :class:`Recompute` entry of ``name``; ``ValueError`` naming ``train.recompute`` otherwise."""
    if name not in RECOMPUTE:
        raise ValueError(f"train.recompute={name!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
    return RECOMPUTE[name]
