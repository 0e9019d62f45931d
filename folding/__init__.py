"""folding: a PyTorch training engine for Mixture-of-Experts models with MoE Parallel Folding.

Tensor names end in their shape (``routing_map_TE`` is ``[T, E]``); the one legend of those suffixes
is ``docs/shapes.md``.
"""

__version__ = "0.1.0"
