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

Usage::

    model = MoETransformer(cfg, parallel_state=ps)
    compile_dense(model)                 # before the first forward; gradients unchanged (to round-off)
"""

from __future__ import annotations

from typing import Iterable, Union

import torch
from torch import nn

from .block import TransformerLayer


def compile_dense(models: Union[nn.Module, Iterable[nn.Module]], **compile_kwargs) -> int:
    """Compile the dense sublayer of every :class:`TransformerLayer` inside ``models`` (a model, a
    pipeline chunk, or a list of them) in place; return how many layers were compiled.

    ``compile_kwargs`` go to :func:`torch.compile` (e.g. ``mode="max-autotune"``). Calling it twice on
    the same layer is a no-op for that layer.
    """
    if isinstance(models, nn.Module):
        models = [models]
    count = 0
    for model in models:
        for layer in model.modules():
            if isinstance(layer, TransformerLayer) and not getattr(layer, "_dense_compiled", False):
                layer._attention = torch.compile(layer._attention, **compile_kwargs)
                layer._dense_compiled = True
                count += 1
    return count
