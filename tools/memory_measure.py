"""Measure what the optimizer really allocates per rank, for checking the analytic memory model
(``tools/memory.py --measure``).

:class:`ShapedModel` holds, for one rank, parameters with the exact local shapes and tags that a
model of :class:`~folding.planning.memory.ModelSizes` has under a layout (no forward: it exists to
build a :class:`~folding.optim.FoldedOptimizer` and read its buffers). :func:`measure_on_rank` does
that inside an initialized process group and returns the measured bytes next to the model's.

Usage (one call per rank, e.g. through ``folding.testing.RankPool``)::

    measure_on_rank(sizes, dict(tp=2, ep=2, etp=2), distributed=True, dtype="bfloat16")
"""

from __future__ import annotations

import dataclasses
from typing import Dict

import torch
import torch.distributed as dist

from folding.optim.config import OptimConfig
from folding.optim.optimizer import FoldedOptimizer
from folding.parallel import ParallelLayout, build_parallel_state
from folding.parallel.params import mark_param
from folding.planning.memory import ModelSizes, memory_per_rank, stage_layers


class ShapedModel(torch.nn.Module):
    """One rank's parameters of a ``ModelSizes`` model on pipeline stage ``stage`` (zeros, tagged)."""

    def __init__(self, sizes: ModelSizes, layout: ParallelLayout, *, stage: int, dtype: torch.dtype):
        super().__init__()
        s, tp, etp, h = sizes, layout.tp, layout.etp, sizes.hidden_size
        self._dtype = dtype

        def add(name, shape, **tags):
            self.register_parameter(name, mark_param(torch.nn.Parameter(torch.zeros(*shape, dtype=dtype)), **tags))

        tied = s.tied_embeddings and layout.pp > 1
        if stage == 0:
            add("embedding_weight", (s.vocab_size // tp, h), tp_sharded=True, tp_dim=0, embedding_tied=tied)
        for i in stage_layers(s, layout, stage):
            for j in range(s.norms_per_layer):
                add(f"l{i}_norm{j}_weight", (h,), sequence_parallel=True)
            if i not in s.dense_layers:
                add(f"l{i}_router_weight", (s.num_experts, h), sequence_parallel=True)
            if s.num_attention_heads:
                nq = s.num_attention_heads
                nkv = s.num_query_groups or nq
                d = s.head_dim or h // nq
                add(f"l{i}_qkv_weight", ((nq + 2 * nkv) * d // tp, h), tp_sharded=True, tp_dim=0)
                if s.qkv_bias:
                    add(f"l{i}_qkv_bias", ((nq + 2 * nkv) * d // tp,), tp_sharded=True, tp_dim=0)
                if s.qk_norm == "head":
                    add(f"l{i}_qk_norm_weight", (2 * d,), sequence_parallel=True)
                elif s.qk_norm == "full":
                    add(f"l{i}_qk_norm_weight", ((nq + nkv) * d // tp,), tp_sharded=True, tp_dim=0)
                add(f"l{i}_proj_weight", (h, nq * d // tp), tp_sharded=True, tp_dim=1)
            if i in s.dense_layers:
                add(f"l{i}_dense_fc1_weight", (2 * s.ffn_hidden_size // tp, h), tp_sharded=True, tp_dim=0)
                add(f"l{i}_dense_fc2_weight", (h, s.ffn_hidden_size // tp), tp_sharded=True, tp_dim=1)
                continue
            for tag, f, gated in (
                ("mlp", s.dense_ffn_hidden_size, s.dense_gated),
                ("shared", s.shared_expert_ffn_hidden_size, True),
            ):
                if f:
                    w = (2 if gated else 1) * f
                    add(f"l{i}_{tag}_fc1_weight", (w // tp, h), tp_sharded=True, tp_dim=0)
                    add(f"l{i}_{tag}_fc2_weight", (h, f // tp), tp_sharded=True, tp_dim=1)
                    if tag == "mlp" and s.dense_bias:
                        add(f"l{i}_mlp_fc1_bias", (w // tp,), tp_sharded=True, tp_dim=0)
                        add(f"l{i}_mlp_fc2_bias", (h,), sequence_parallel=True)
            if s.shared_expert_gate:
                add(f"l{i}_shared_gate_weight", (1, h), sequence_parallel=True)
            el, fe = s.num_experts // layout.ep, s.moe_ffn_hidden_size // etp
            # the engine's GroupedMLP layout: fc1 [E/EP, 2·F/ETP, H] (gate; up), fc2 [E/EP, H, F/ETP]
            add(f"l{i}_experts_fc1", (el, 2 * fe, h), expert=True, tp_sharded=True, tp_dim=1)
            add(f"l{i}_experts_fc2", (el, h, fe), expert=True, tp_sharded=True, tp_dim=2)
        if stage == layout.pp - 1:
            add("final_norm_weight", (h,), sequence_parallel=True)
            if not s.tied_embeddings or layout.pp > 1:
                add("output_weight", (s.vocab_size // tp, h), tp_sharded=True, tp_dim=0, embedding_tied=tied)


def measure_on_rank(
    sizes: ModelSizes, layout_kwargs: Dict, *, distributed: bool, dtype: str = "float32", bucket_size: int = 40_000_000
) -> Dict:
    """Build this rank's :class:`ShapedModel` and optimizer; return ``{"measured", "model", "rank"}``
    (bytes by kind, from ``FoldedOptimizer.memory_bytes`` and ``memory_per_rank``). Collective."""
    layout = ParallelLayout(world_size=dist.get_world_size(), **layout_kwargs)
    ps = build_parallel_state(layout)
    try:
        tdtype = getattr(torch, dtype)
        model = ShapedModel(sizes, layout, stage=ps.pp_rank, dtype=tdtype)
        opt = FoldedOptimizer(
            model,
            OptimConfig(distributed=distributed, decay_style="constant", bucket_size=bucket_size),
            parallel_state=ps,
        )
        est = memory_per_rank(
            sizes,
            layout,
            param_bytes=torch.tensor([], dtype=tdtype).element_size(),
            distributed=distributed,
            stage=ps.pp_rank,
        )
        model_bytes = {k: v for k, v in dataclasses.asdict(est).items() if k not in ("activations", "stage")}
        return {"rank": dist.get_rank(), "stage": ps.pp_rank, "measured": opt.memory_bytes(), "model": model_bytes}
    finally:
        ps.destroy()
