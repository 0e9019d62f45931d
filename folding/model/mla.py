"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the attention TP (heads) and CP (sequence) groups.

Input and output are sequence-parallel shards ``[S_cp/TP, B, H]``. Steps, with the sizes of
:class:`~folding.model.mla_config.MLAConfig` (``Rq`` = q_lora_rank, ``Rkv`` = kv_lora_rank,
``dn``/``dr`` = nope/rope dims per head, ``dv`` = value dims, ``N`` heads):

1. On this rank's own tokens (no communication): the low-rank down-projections ``q_a_proj``
   (``H -> Rq``) and ``kv_a_proj_with_mqa`` (``H -> Rkv + dr``: the KV latent and the rotary key
   shared by all heads), and the latent norms ``q_a_layernorm`` / ``kv_a_layernorm``. These weights
   are replicated over TP; under sequence parallelism each TP rank sees other tokens, so their
   gradients are TP-partial and are tagged ``sequence_parallel`` (summed over TP, like norms).
2. One all-gather over TP of the concatenated latents (``Rq + Rkv + dr`` per token instead of ``H``;
   backward: reduce-scatter), then the column-parallel up-projections: ``q_b_proj`` (``Rq -> N·(dn+dr)``)
   and, after step 3, ``kv_b_proj`` (``Rkv -> N·(dn+dv)``), each rank computing its ``N/TP`` heads.
   Without ``q_lora_rank`` the query is one column-parallel ``q_proj`` on the gathered hidden state.
3. RoPE on the rotary query dims and the shared rotary key, at the tokens' true positions (DeepSeek's
   interleaved pairs are de-interleaved first: the same permutation on queries and keys leaves the
   scores unchanged). Under CP the *compressed* KV (normed latent + rotated shared key,
   ``Rkv + dr`` per token) is all-gathered over CP (backward: reduce-scatter) and ``kv_b_proj`` runs on
   the whole sequence, which moves ``Rkv + dr`` values per token instead of ``N/TP·(dn+dr+dv)``.
4. Causal SDPA with the value width ``dv`` != the query/key width ``dn + dr`` and the softmax scale
   ``(dn+dr)^-1/2`` times YaRN's ``mscale(factor, mscale_all_dim)²``; the row-parallel ``o_proj``
   reduce-scatters back to the sequence shard.

Parameter names follow Hugging Face (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` or ``q_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``).

Usage::

    attn = MLAttention(config, tp_group=ps.groups.tp, cp_group=ps.groups.cp, output_init_std=std)
    y_SBH = attn(x_SBH, cos_SD, sin_SD, kv_order, chunk_starts)   # from MoETransformer.rope()
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..memory.discard import discard_until_backward
from ..memory.offload import offload_region
from ..overlap import wgrad
from ..parallel.collectives import group_rank, group_size
from ..parallel.linear import ColumnParallelLinear, RowParallelLinear, sp_column_linears, sp_gather
from ..parallel.params import mark_param, set_init_spec
from .config import ModelConfig
from .context_parallel import attention_core, gather_kv, sdpa_values
from .norm import RMSNorm
from .rope import apply_rope
from .rope_yarn import yarn_softmax_scale


class ReplicatedLinear(nn.Module):
    """``y = x W^T`` with ``W [out, in]`` replicated over TP and applied to this rank's sequence shard;
    the weight is tagged ``sequence_parallel`` (TP-partial gradients, summed over TP). ``delay_wgrad``:
    its gradient is computed behind the backward's next exchange (:mod:`folding.overlap.wgrad`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        init_std: float,
        device=None,
        dtype=torch.float32,
        delay_wgrad: bool = False,
    ):
        super().__init__()
        self.delay_wgrad = delay_wgrad
        """Weight gradient deferred behind the backward's next exchange."""
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        mark_param(self.weight, sequence_parallel=True)
        set_init_spec(self.weight, full_shape=(out_features, in_features), std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in] -> [..., out]``."""
        return (wgrad.linear if self.delay_wgrad else F.linear)(x, self.weight)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...)`` along the last dim: DeepSeek's interleaved
    rotary pairs into the "rotate half" layout."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    """Multi-head latent attention; heads split over TP, sequence over CP (see the module docstring)."""

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
        recompute_up_proj: bool = False,
    ):
        """``delay_wgrad`` (``parallel.delay_wgrad``): every projection's weight gradient is computed
        behind the backward's next exchange (:mod:`folding.overlap.wgrad`). ``recompute_core`` /
        ``recompute_up_proj``: the ``core_attn`` / ``mla_up_proj`` recompute modules
        (:mod:`folding.model.recompute`; see the attributes)."""
        super().__init__()
        self.recompute_core = recompute_core
        """The attention core runs under a checkpoint (``core_attn``)."""
        self.recompute_up_proj = recompute_up_proj
        """``mla_up_proj``: the core's queries, keys and values (the up-projections' and RoPE's outputs)
        are freed once the core has run forward and recomputed from the kept latents when backward
        reaches it (:mod:`folding.memory.discard`)."""
        m = config.mla
        if m is None:
            raise ValueError("MLAttention needs model.mla (a folding.model.mla_config.MLAConfig)")
        tp = group_size(tp_group)
        N = config.num_attention_heads
        if N % tp:
            raise ValueError(
                f"model.num_attention_heads={N} is not divisible by parallel.tp={tp}; "
                f"choose parallel.tp among the divisors of {N}"
            )
        self.tp_group, self.cp_group, self.mla = tp_group, cp_group, m
        self.heads = N // tp
        self.head_offset = group_rank(tp_group) * self.heads
        """Global index of this rank's first head (the attention dropout's coordinates)."""
        self.scale = yarn_softmax_scale(1.0 / math.sqrt(m.qk_head_dim), config.yarn)
        H, std = config.hidden_size, config.init_std
        kw = dict(device=device, dtype=dtype)
        col = dict(tp_group=tp_group, init_std=std, delay_wgrad=delay_wgrad, **kw)
        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(H, N * m.qk_head_dim, name="query features", **col)
        else:
            self.q_a_proj = ReplicatedLinear(H, m.q_lora_rank, init_std=std, delay_wgrad=delay_wgrad, **kw)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, eps=m.latent_norm_eps, **kw)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, N * m.qk_head_dim, name="query features", **col)
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            H, m.kv_lora_rank + m.qk_rope_head_dim, init_std=std, delay_wgrad=delay_wgrad, **kw
        )
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, eps=m.latent_norm_eps, **kw)
        self.kv_b_proj = ColumnParallelLinear(
            m.kv_lora_rank, N * (m.qk_nope_head_dim + m.v_head_dim), name="key/value features", **col
        )
        self.o_proj = RowParallelLinear(
            N * m.v_head_dim,
            H,
            tp_group=tp_group,
            init_std=output_init_std,
            name="attention output features",
            delay_wgrad=delay_wgrad,
            **kw,
        )

    def _rope(self, x: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
        if self.mla.rope_interleave:
            x = deinterleave(x)
        return apply_rope(x, cos_SD, sin_SD)

    def forward(
        self,
        x_SBH: torch.Tensor,
        cos_SD: torch.Tensor,
        sin_SD: torch.Tensor,
        kv_order: Optional[torch.Tensor],
        chunk_starts: Tuple[int, ...],
        dropout=None,
    ) -> torch.Tensor:
        """``x [S_cp/TP, B, H]`` -> ``[S_cp/TP, B, H]``; ``cos/sin [S_cp, dr]`` at this CP rank's
        positions, ``kv_order``, ``chunk_starts`` and ``dropout`` as in
        :class:`~folding.model.attention.Attention`."""
        m, tp = self.mla, self.tp_group
        Rkv, dr, dv = m.kv_lora_rank, m.qk_rope_head_dim, m.v_head_dim
        with offload_region("qkv_linear"):  # the projections that read the layer's normed input
            kv_a = self.kv_a_proj_with_mqa(x_SBH)
            q_in = sp_column_linears(x_SBH, (self.q_proj,), tp)[0] if m.q_lora_rank is None else self.q_a_proj(x_SBH)
        kv_lat = self.kv_a_layernorm(kv_a[..., :Rkv])
        if m.q_lora_rank is None:
            kv = sp_gather(torch.cat((kv_lat, kv_a[..., Rkv:]), dim=-1), tp)
        else:  # one TP all-gather of both latents
            q_lat = self.q_a_layernorm(q_in)
            lat = sp_gather(torch.cat((q_lat, kv_lat, kv_a[..., Rkv:]), dim=-1), tp)
            q_in, kv = lat[..., : m.q_lora_rank], lat[..., m.q_lora_rank :]
        S, B, _ = kv.shape  # S_cp: the TP-gathered sequence
        k_pe = self._rope(kv[..., Rkv:].view(S, B, 1, dr), cos_SD, sin_SD)
        kv = torch.cat((kv[..., :Rkv], k_pe.view(S, B, dr)), dim=-1)
        if group_size(self.cp_group) > 1:  # the compressed KV of the whole sequence, in sequence order
            kv = gather_kv(kv, self.cp_group)[kv_order]
        up = functools.partial(self._up_proj, q_in, kv, cos_SD, sin_SD)
        q, k, v = up()
        with offload_region("core_attn"):
            out = attention_core(
                q.permute(1, 2, 0, 3),
                k.permute(1, 2, 0, 3),
                v.permute(1, 2, 0, 3),
                scale=self.scale,
                chunk_starts=chunk_starts,
                recompute=self.recompute_core,
                dropout=dropout,
                head_offset=self.head_offset,
            )
        if self.recompute_up_proj:  # mla_up_proj: the core's q, k, v come back from the kept latents
            first = 0 if m.q_lora_rank is not None else 1  # without q LoRA, q_in is q itself: keep q
            discard_until_backward([q, k, v][first:], after=out, refill=lambda: up()[first:])
        out = out[..., :dv].permute(2, 0, 1, 3).reshape(S, B, self.heads * dv)
        with offload_region("attn_proj"):
            return self.o_proj(out)

    def _up_proj(self, q_in: torch.Tensor, kv: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor):
        """The attention core's ``q [S, B, N/TP, dn+dr]``, ``k [Sk, B, N/TP, dn+dr]`` and ``v`` (as the
        kernel takes it, :func:`~folding.model.context_parallel.sdpa_values`) from the query latent (or,
        without q LoRA, the projected query) and the compressed KV: the up-projections and the queries'
        RoPE (the ``mla_up_proj`` recompute module's region)."""
        m = self.mla
        Rkv, dn, dr, dv = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        q = self.q_b_proj(q_in) if m.q_lora_rank is not None else q_in
        S, B, _ = q.shape
        q = q.view(S, B, self.heads, dn + dr)
        q = torch.cat((q[..., :dn], self._rope(q[..., dn:], cos_SD, sin_SD)), dim=-1)
        Sk = kv.shape[0]
        kv_up = self.kv_b_proj(kv[..., :Rkv]).view(Sk, B, self.heads, dn + dv)
        k_pe = kv[..., Rkv:].view(Sk, B, 1, dr).expand(Sk, B, self.heads, dr)
        k = torch.cat((kv_up[..., :dn], k_pe), dim=-1)
        return q, k, sdpa_values(kv_up[..., dn:], dn + dr)
