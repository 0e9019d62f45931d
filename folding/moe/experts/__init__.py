"""Experts: every local expert's SwiGLU MLP as grouped GEMMs, with pluggable backends.

- :mod:`.grouped`: :class:`~folding.moe.experts.grouped.GroupedMLP`, the module.
- :mod:`.backends`: the grouped-GEMM backends; :mod:`.select`: which backend runs where.
- :mod:`.scaled`, :mod:`.mxfp8`: FP8 / MXFP8 on the ``torch`` backend; :mod:`.te`: TransformerEngine.
- :mod:`.fp8_shapes`: the shapes an FP8 recipe's grouped GEMMs accept; :mod:`.swiglu`: the fused
  activation with the router-probability multiply.
"""
