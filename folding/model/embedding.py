"""Vocab-parallel word embedding: the table's rows are split over the attention TP group.

Rank r holds rows ``[r*V/TP, (r+1)*V/TP)``. Each rank looks up the ids that fall in its range (zero
rows elsewhere); the partial ``[S, B, H]`` results are reduce-scattered over TP along the sequence,
which both sums the partial lookups and produces the sequence-parallel shard ``[S/TP, B, H]``
(forward: reduce-scatter; backward: all-gather of the gradient).

Usage::

    emb = VocabParallelEmbedding(vocab_size, hidden_size, tp_group=ps.groups.tp)
    x_SBH = emb(input_ids_BS)         # [S/TP, B, H]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.collectives import group_rank, group_size, reduce_scatter_to_sequence_region
from ..parallel.params import mark_param, set_init_spec


class VocabParallelEmbedding(nn.Module):
    """Embedding table ``[V, H]`` sharded by rows over TP; output sequence-sharded ``[S/TP, B, H]``."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        tp_group,
        init_std: float = 0.02,
        tied: bool = False,
        device=None,
        dtype=torch.float32,
    ):
        super().__init__()
        tp, r = group_size(tp_group), group_rank(tp_group)
        if vocab_size % tp:
            raise ValueError(
                f"model.vocab_size={vocab_size} is not divisible by parallel.tp={tp}; "
                f"pad the vocabulary to a multiple of {tp} or change parallel.tp"
            )
        self.tp_group = tp_group
        self.vocab_start = r * (vocab_size // tp)
        self.vocab_end = self.vocab_start + vocab_size // tp
        self.weight = nn.Parameter(torch.empty(vocab_size // tp, hidden_size, device=device, dtype=dtype))
        mark_param(self.weight, tp_sharded=True, embedding_tied=tied)
        set_init_spec(self.weight, full_shape=(vocab_size, hidden_size), shards=((0, r, tp),), std=init_std)

    def forward(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, S]`` (this CP rank's positions) -> ``[S/TP, B, H]``."""
        ids_SB = input_ids_BS.t()
        if group_size(self.tp_group) == 1:
            return F.embedding(ids_SB, self.weight)
        outside = (ids_SB < self.vocab_start) | (ids_SB >= self.vocab_end)
        local = (ids_SB - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        return reduce_scatter_to_sequence_region(out, self.tp_group)
