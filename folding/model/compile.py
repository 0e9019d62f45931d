"""``torch.compile`` of the dense parts of a model: each layer's input norm and attention sublayer.

What is compiled, per :class:`~folding.model.block.TransformerLayer`: ``input_norm`` followed by the
attention block (QKV projection, RoPE, the attention core, the output projection, and the
sequence-parallel / context-parallel communication between them, which Dynamo keeps as collectives
in the graph or runs eagerly across a graph break). Inductor fuses the element-wise work around the
GEMMs (norm, RoPE, the Q/K/V split and layout changes); the GEMMs and the attention kernel stay
library calls. The MoE block (router, dispatcher, experts) is not compiled: its shapes depend on the
routing, and the dropless dispatcher reads split sizes on the host. Recompute modes keep working:
``selective`` checkpoints the compiled sublayer.

It is a switch (``train.compile``, off by default) because it pays only where element-wise work is
a visible share of the step and the compile time (seconds per distinct shape, once per process) is
amortized: ``benchmarks/bench_train.py`` reports the side-by-side step with and without it. On CPU,
Inductor needs a C++ compiler.

A construction setting, like every other: the layer is built compiled, nothing is swapped on a built
model.

Usage::

    model = MoETransformer(cfg, parallel_state=ps, settings=LayerSettings(compile_dense=True))
"""

from __future__ import annotations

from typing import Callable

import torch


def dense_sublayer(fn: Callable, *, compiled: bool) -> Callable:
    """The dense sublayer ``fn`` (a layer's input norm + attention) a :class:`TransformerLayer` runs:
    through ``torch.compile`` when ``compiled`` (``LayerSettings.compile_dense``), else as it is."""
    return torch.compile(fn) if compiled else fn
