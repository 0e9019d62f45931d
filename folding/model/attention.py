"""Causal self-attention with GQA and RoPE over the attention TP (heads) and CP (sequence) groups.

Input and output are sequence-parallel shards ``[S_cp/TP, B, H]`` where ``S_cp`` is this CP rank's
share of the sequence. Steps: all-gather the sequence over TP (SP) fused with the q/k/v column-parallel
projections (this TP rank's ``heads/TP`` query heads and ``kv_heads/TP`` KV heads; only the shard is
kept for backward, see :func:`~folding.parallel.linear.sp_column_linears`), the optional q/k RMSNorm
(``config.qk_norm``: per head, or over the whole projection with its sum of squares all-reduced over
TP, see :mod:`.norm`), RoPE at the tokens' true positions, all-gather K/V over CP (see
:mod:`.context_parallel`), PyTorch SDPA (causal; under CP one call per local chunk with a lower-right
causal bias over its prefix), and the row-parallel output projection reduce-scattered back to the
sequence shard. Names follow Hugging Face (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``q_norm``, ``k_norm``).

Usage::

    attn = Attention(config, tp_group=ps.groups.tp, cp_group=ps.groups.cp)
    y = attn(x_SBH, cos_SD, sin_SD, kv_order, chunk_starts)   # from MoETransformer.rope()
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import nn

from ..memory.offload import offload_region
from ..parallel.collectives import group_rank, group_size
from ..parallel.linear import ColumnParallelLinear, RowParallelLinear, sp_column_linears
from .config import ModelConfig
from .context_parallel import attention_core, gather_kv
from .norm import RMSNorm, ShardedRMSNorm
from .rope import apply_rope


class Attention(nn.Module):
    """GQA causal self-attention; heads split over TP, sequence over CP (all-gather K/V)."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        tp_group,
        cp_group,
        output_init_std: float,
        device=None,
        dtype=torch.float32,
        delay_wgrad: bool = False,
        recompute_core: bool = False,
    ):
        """``delay_wgrad`` (``parallel.delay_wgrad``): the projections' weight (and bias) gradients are
        computed behind the backward's next exchange (:mod:`folding.overlap.wgrad`). ``recompute_core``:
        the ``core_attn`` recompute module (:mod:`folding.model.recompute`): the attention core runs under
        a checkpoint, keeping its inputs (the queries, keys and values, kept anyway) but not its
        statistics."""
        super().__init__()
        self.recompute_core = recompute_core
        """The attention core is recomputed in backward (``core_attn``)."""
        tp = group_size(tp_group)
        for what, n in (
            ("model.num_attention_heads", config.num_attention_heads),
            ("model.num_kv_heads", config.num_kv_heads),
        ):
            if n % tp:
                raise ValueError(
                    f"{what}={n} is not divisible by parallel.tp={tp}; choose parallel.tp among the divisors of {n}"
                )
        self.tp_group, self.cp_group = tp_group, cp_group
        d = self.head_dim = config.kv_channels
        self.heads = config.num_attention_heads // tp
        self.head_offset = group_rank(tp_group) * self.heads
        """Global index of this rank's first query head (the attention dropout's coordinates)."""
        self.kv_heads = config.num_kv_heads // tp
        H, kw = config.hidden_size, dict(tp_group=tp_group, device=device, dtype=dtype)
        lin = dict(delay_wgrad=delay_wgrad, **kw)
        self.q_proj = ColumnParallelLinear(
            H,
            config.num_attention_heads * d,
            bias=config.qkv_bias,
            init_std=config.init_std,
            name="query features",
            **lin,
        )
        self.k_proj = ColumnParallelLinear(
            H, config.num_kv_heads * d, bias=config.qkv_bias, init_std=config.init_std, name="key features", **lin
        )
        self.v_proj = ColumnParallelLinear(
            H, config.num_kv_heads * d, bias=config.qkv_bias, init_std=config.init_std, name="value features", **lin
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * d, H, init_std=output_init_std, name="attention output features", **lin
        )
        self.qk_norm = config.qk_norm
        if config.qk_norm == "head":  # Qwen3-MoE: one [head_dim] weight each, shared by all heads
            self.q_norm = RMSNorm(d, eps=config.norm_eps, device=device, dtype=dtype)
            self.k_norm = RMSNorm(d, eps=config.norm_eps, device=device, dtype=dtype)
        elif config.qk_norm == "full":  # OLMoE: over each token's whole q (k) projection output
            self.q_norm = ShardedRMSNorm(
                config.num_attention_heads * d, eps=config.norm_eps, name="query features", **kw
            )
            self.k_norm = ShardedRMSNorm(config.num_kv_heads * d, eps=config.norm_eps, name="key features", **kw)

    def forward(
        self,
        x_SBH: torch.Tensor,
        cos_SD: torch.Tensor,
        sin_SD: torch.Tensor,
        kv_order: Optional[torch.Tensor],
        chunk_starts: Tuple[int, ...],
        dropout=None,
    ) -> torch.Tensor:
        """``x [S_cp/TP, B, H]`` -> ``[S_cp/TP, B, H]``. ``cos/sin [S_cp, D]`` are at this CP rank's
        positions; under CP, ``kv_order`` puts the CP-gathered keys in sequence order and
        ``chunk_starts`` are the first positions of this rank's two chunks (see :mod:`.context_parallel`).
        ``dropout``: the layer's :class:`~folding.model.dropout.DropoutKeys` (attention probabilities),
        or ``None``."""
        with offload_region("qkv_linear"):
            q, k, v = sp_column_linears(x_SBH, (self.q_proj, self.k_proj, self.v_proj), self.tp_group)
        S, B, _ = q.shape  # S_cp: the TP-gathered sequence
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(S, B, self.heads, self.head_dim)
        k = k.view(S, B, self.kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.view(S, B, self.kv_heads, self.head_dim)
        q, k = apply_rope(q, cos_SD, sin_SD), apply_rope(k, cos_SD, sin_SD)
        # GQA without copying K/V: query head j attends with KV head j // (heads / kv_heads)
        q_BASD = q.permute(1, 2, 0, 3)
        if group_size(self.cp_group) > 1:  # full-sequence K/V in sequence order
            k, v = gather_kv(k, self.cp_group)[kv_order], gather_kv(v, self.cp_group)[kv_order]
        with offload_region("core_attn"):
            out = attention_core(
                q_BASD,
                k.permute(1, 2, 0, 3),
                v.permute(1, 2, 0, 3),
                scale=1.0 / math.sqrt(self.head_dim),
                chunk_starts=chunk_starts,
                recompute=self.recompute_core,
                enable_gqa=self.kv_heads != self.heads,
                dropout=dropout,
                head_offset=self.head_offset,
            )
        out = out.permute(2, 0, 1, 3).reshape(S, B, self.heads * self.head_dim)
        with offload_region("attn_proj"):
            return self.o_proj(out)
