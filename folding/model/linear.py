"""Tensor-parallel linears over the attention TP group, with sequence parallelism (SP).

Activations are sequence-first ``[S, B, H]``. Under SP (always on when TP>1) each TP rank holds
``S/TP`` tokens between blocks. A block enters with :func:`sp_column_linears`: the all-gather of the
sequence fused with the block's :class:`ColumnParallelLinear` s (weight rows sharded over TP: each
rank produces its slice of the output features), which keeps only the sequence shard for backward
and gathers it again there (:func:`folding.parallel.sequence_parallel.gather_linears`). The block
then ends with a :class:`RowParallelLinear` (weight columns sharded over TP) whose partial sums are
reduce-scattered back to the sequence shard. :func:`sp_gather` is the plain all-gather, for
consumers that are not column-parallel linears.

Usage::

    gate, up = sp_column_linears(x_SBH, [gate_proj, up_proj], tp_group)   # [S, B, Fl] each
    y_SBH = down(act(gate) * up)                                           # RowParallelLinear -> [S/TP, B, H]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.collectives import (
    gather_from_sequence_region,
    group_rank,
    group_size,
    reduce_scatter_to_sequence_region,
)
from ..parallel.params import mark_param, set_init_spec
from ..parallel.sequence_parallel import gather_linears


def sp_gather(x_SBH: torch.Tensor, tp_group) -> torch.Tensor:
    """Sequence-parallel entry of a TP region.

    Forward: all-gather along the sequence (dim 0) over TP. Backward: reduce-scatter (sum) of the
    gradient, since every TP rank's column-parallel shard contributes a partial input gradient.
    """
    return gather_from_sequence_region(x_SBH, tp_group, grad_reduce=True)


def sp_column_linears(x_SBH: torch.Tensor, linears, tp_group):
    """Sequence-parallel entry fused with the :class:`ColumnParallelLinear` s that read it.

    Forward: all-gather of ``x [S/TP, B, H]`` over TP along the sequence, then each linear (a tuple of
    ``[S, B, out_i/TP]``). Backward: the shard is all-gathered again for the weight gradients, and
    the input gradient is reduce-scattered (sum) over TP; only the shard is kept between the two.
    """
    return gather_linears(x_SBH, [m.weight for m in linears], [m.bias for m in linears], tp_group)


def _check_divisible(what: str, n: int, tp: int) -> None:
    if n % tp:
        raise ValueError(
            f"{what}={n} is not divisible by parallel.tp={tp}; choose parallel.tp among the divisors of {n}"
        )


class ColumnParallelLinear(nn.Module):
    """``y = x W^T (+ b)`` with ``W [out, in]`` split by rows over TP: rank r holds ``W[r*out/TP:(r+1)*out/TP]``.

    Input: the full (gathered) activation ``[..., in]``; output ``[..., out/TP]``. No communication
    here: the caller's :func:`sp_gather` handles it. Weight (and bias) are tagged ``tp_sharded``
    along dim 0.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group,
        bias: bool = False,
        init_std: float = 0.02,
        name: str = "features",
        device=None,
        dtype=torch.float32,
    ):
        super().__init__()
        tp, r = group_size(tp_group), group_rank(tp_group)
        _check_divisible(name, out_features, tp)
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features, device=device, dtype=dtype))
        mark_param(self.weight, tp_sharded=True, tp_dim=0)
        set_init_spec(self.weight, full_shape=(out_features, in_features), shards=((0, r, tp),), std=init_std)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features // tp, device=device, dtype=dtype))
            mark_param(self.bias, tp_sharded=True, tp_dim=0)
            set_init_spec(self.bias, full_shape=(out_features,), shards=((0, r, tp),), kind="zeros")
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in] -> [..., out/TP]``."""
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = x W^T`` with ``W [out, in]`` split by columns over TP; partial sums reduce-scattered.

    Input ``[S, B, in/TP]`` (full sequence); output ``[S/TP, B, out]``: forward reduce-scatter over
    TP along the sequence, backward all-gather of the gradient. Weight tagged ``tp_sharded`` dim 1.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group,
        init_std: float = 0.02,
        name: str = "features",
        device=None,
        dtype=torch.float32,
    ):
        super().__init__()
        tp, r = group_size(tp_group), group_rank(tp_group)
        _check_divisible(name, in_features, tp)
        self.tp_group = tp_group
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp, device=device, dtype=dtype))
        mark_param(self.weight, tp_sharded=True, tp_dim=1)
        set_init_spec(self.weight, full_shape=(out_features, in_features), shards=((1, r, tp),), std=init_std)

    def forward(self, x_SBI: torch.Tensor) -> torch.Tensor:
        """``[S, B, in/TP] -> [S/TP, B, out]``."""
        return reduce_scatter_to_sequence_region(F.linear(x_SBI, self.weight), self.tp_group)
