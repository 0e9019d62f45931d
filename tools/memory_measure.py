"""Measure what the optimizer really allocates per rank, for checking the analytic memory model
(``tools/memory.py --measure``).

:func:`measure_on_rank` builds, inside an initialized process group, this rank's real model chunks
(:func:`folding.model.chunks.build_stage_chunks`, the trainer's own) and optimizer, and returns the
bytes the optimizer holds next to what :func:`folding.planning.memory.memory_per_rank` predicts for
the same model and stage. Every parameter the model has is measured, whatever the architecture
(multi-head latent attention, multi-token prediction, shared experts, dense layers).

Usage (one call per rank, e.g. through ``folding.testing.RankPool``; use a tiny preset)::

    measure_on_rank(get_preset("deepseek_v3_tiny"), dict(tp=2, pp=2, ep=2, etp=1), distributed=True,
                    dtype="bfloat16")
"""

from __future__ import annotations

import dataclasses
from typing import Dict

import torch
import torch.distributed as dist

from folding.model.chunks import build_stage_chunks
from folding.model.config import ModelConfig
from folding.moe.settings import LayerSettings
from folding.optim.config import OptimConfig
from folding.optim.optimizer import FoldedOptimizer
from folding.parallel import ParallelLayout, build_parallel_state
from folding.planning.memory import memory_per_rank


def measure_on_rank(
    model_config: ModelConfig,
    layout_kwargs: Dict,
    *,
    distributed: bool,
    dtype: str = "float32",
    bucket_size: int = 40_000_000,
) -> Dict:
    """Build this rank's model chunks and optimizer; return ``{"rank", "stage", "measured", "model"}``
    (bytes by kind, from ``FoldedOptimizer.memory_bytes`` and ``memory_per_rank``). Collective."""
    layout = ParallelLayout(world_size=dist.get_world_size(), num_experts=model_config.moe.num_experts, **layout_kwargs)
    ps = build_parallel_state(layout)
    try:
        tdtype = getattr(torch, dtype)
        model = torch.nn.ModuleList(
            build_stage_chunks(
                model_config=model_config, parallel_state=ps, settings=LayerSettings(params_dtype=tdtype)
            )
        )
        opt = FoldedOptimizer(
            model,
            OptimConfig(distributed=distributed, decay_style="constant", bucket_size=bucket_size),
            parallel_state=ps,
        )
        est = memory_per_rank(
            model_config,
            layout,
            param_bytes=torch.tensor([], dtype=tdtype).element_size(),
            distributed=distributed,
            stage=ps.coords.pp.rank,
        )
        model_bytes = {k: v for k, v in dataclasses.asdict(est).items() if k not in ("activations", "stage")}
        return {
            "rank": dist.get_rank(),
            "stage": ps.coords.pp.rank,
            "measured": opt.memory_bytes(),
            "model": model_bytes,
        }
    finally:
        ps.destroy()
