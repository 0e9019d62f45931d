"""The trainer's two model calls: this rank's chunks and one step's micro-batches.

Both come from :mod:`folding.pipeline.stage` (one code path for every ``parallel.pp``, including 1);
this module only names them for the training package.

Usage::

    chunks = build_stage_chunks(model_config=m, moe_config=moe, parallel_state=ps, recompute="none")
    out = run_microbatches(chunks, microbatches, parallel_state=ps, loss_scale=1 / n_tokens)
"""
from ..pipeline.stage import build_stage_chunks, moe_factory_for, run_microbatches

__all__ = ["build_stage_chunks", "moe_factory_for", "run_microbatches"]
