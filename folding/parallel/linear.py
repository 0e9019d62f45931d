"""Tensor-parallel linears over the attention TP group, with sequence parallelism (SP).

Activations are sequence-first ``[S, B, H]``. Under SP (always on when TP>1) each TP rank holds
``S/TP`` tokens between blocks. A block enters with :func:`sp_column_linears`: the all-gather of the
sequence fused with the block's :class:`ColumnParallelLinear` s (weight rows sharded over TP: each
rank produces its slice of the output features), which keeps only the sequence shard for backward
and gathers it again there (:func:`folding.parallel.sequence_parallel.gather_linears`). The block
then ends with a :class:`RowParallelLinear` (weight columns sharded over TP) whose partial sums are
reduce-scattered back to the sequence shard. :func:`sp_gather` is the plain all-gather, for
consumers that are not column-parallel linears. Modules that keep their weights as plain parameters
(the MoE shared expert's fused ``[gate; up]``) create them with :func:`column_parallel_weight` /
:func:`row_parallel_weight` and run them with :func:`gather_linears` / :func:`row_parallel_linear`.

Usage::

    gate, up = sp_column_linears(x_SBH, [gate_proj, up_proj], tp_group)   # [S, B, Fl] each
    y_SBH = down(act(gate) * up)                                           # RowParallelLinear -> [S/TP, B, H]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..overlap import wgrad
from .collectives import (
    Group,
    gather_from_sequence_region,
    group_rank,
    group_size,
    reduce_scatter_to_sequence_region,
)
from .params import mark_param, set_init_spec
from .sequence_parallel import gather_linears


def sp_gather(x_SBH: torch.Tensor, tp_group: Group) -> torch.Tensor:
    """Sequence-parallel entry of a TP region.

    Forward: all-gather along the sequence (dim 0) over TP. Backward: reduce-scatter (sum) of the
    gradient, since every TP rank's column-parallel shard contributes a partial input gradient.
    """
    return gather_from_sequence_region(x_SBH, tp_group, grad_reduce=True)


def sp_column_linears(x_SBH: torch.Tensor, linears, tp_group: Group):
    """Sequence-parallel entry fused with the :class:`ColumnParallelLinear` s that read it.

    Forward: all-gather of ``x [S/TP, B, H]`` over TP along the sequence, then each linear (a tuple of
    ``[S, B, out_i/TP]``). Backward: the shard is all-gathered again for the weight gradients, and
    the input gradient is reduce-scattered (sum) over TP; only the shard is kept between the two.
    The linears' weight gradients are deferred when they were built with ``delay_wgrad`` (all alike).
    """
    delay = {m.delay_wgrad for m in linears}
    if len(delay) != 1:
        raise ValueError(
            "sp_column_linears: the linears fused on one input must all be built with the same delay_wgrad"
        )
    return gather_linears(
        x_SBH, [m.weight for m in linears], [m.bias for m in linears], tp_group, delay_wgrad=delay.pop()
    )


def _check_divisible(what: str, n: int, tp: int) -> None:
    if n % tp:
        raise ValueError(
            f"{what}={n} is not divisible by parallel.tp={tp}; choose parallel.tp among the divisors of {n}"
        )


def column_parallel_weight(
    in_features: int,
    out_features: int,
    *,
    tp_group: Group,
    parts: int = 1,
    init_std: float = 0.02,
    name: str = "features",
    device=None,
    dtype=torch.float32,
) -> nn.Parameter:
    """The weight of a column-parallel linear: ``parts`` stacked ``[out, in]`` matrices, each split by
    rows over TP; this rank holds ``[parts·out/TP, in]``, its row shard of every part in order.

    Tagged ``tp_sharded``; its value record is the full ``[out, in]`` (``[parts, out, in]`` when
    ``parts > 1``, e.g. a fused SwiGLU ``[gate; up]``: one tensor, one seed) and this rank's shard of
    it. ``name`` is the config field of ``out_features`` (for errors).
    """
    tp, r = group_size(tp_group), group_rank(tp_group)
    _check_divisible(name, out_features, tp)
    w = nn.Parameter(torch.empty(parts * out_features // tp, in_features, device=device, dtype=dtype))
    mark_param(w, tp_sharded=True)
    if parts == 1:
        return set_init_spec(w, full_shape=(out_features, in_features), shards=((0, r, tp),), std=init_std)
    return set_init_spec(w, full_shape=(parts, out_features, in_features), shards=((1, r, tp),), std=init_std)


def row_parallel_weight(
    in_features: int,
    out_features: int,
    *,
    tp_group: Group,
    init_std: float = 0.02,
    name: str = "features",
    device=None,
    dtype=torch.float32,
) -> nn.Parameter:
    """The weight of a row-parallel linear: ``[out, in]`` split by columns over TP; this rank holds
    ``[out, in/TP]``, tagged ``tp_sharded``. ``name`` is the config field of ``in_features`` (for errors)."""
    tp, r = group_size(tp_group), group_rank(tp_group)
    _check_divisible(name, in_features, tp)
    w = mark_param(
        nn.Parameter(torch.empty(out_features, in_features // tp, device=device, dtype=dtype)), tp_sharded=True
    )
    return set_init_spec(w, full_shape=(out_features, in_features), shards=((1, r, tp),), std=init_std)


def row_parallel_linear(
    x_SBI: torch.Tensor, weight: torch.Tensor, tp_group: Group, *, delay_wgrad: bool = False
) -> torch.Tensor:
    """``x W^T`` with ``W`` a :func:`row_parallel_weight` (cast to ``x``'s dtype), its partial sums
    reduce-scattered over TP along dim 0: ``[S, B, in/TP] -> [S/TP, B, out]``. Forward: reduce-scatter
    (sum); backward: all-gather of the gradient. ``delay_wgrad``: the weight gradient is computed behind
    the backward's next exchange (:func:`folding.overlap.wgrad.linear`)."""
    linear = wgrad.linear if delay_wgrad else F.linear
    return reduce_scatter_to_sequence_region(linear(x_SBI, weight.to(x_SBI.dtype)), tp_group)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T (+ b)`` with ``W [out, in]`` split by rows over TP: rank r holds ``W[r*out/TP:(r+1)*out/TP]``.

    Input: the full (gathered) activation ``[..., in]``; output ``[..., out/TP]``. No communication
    here: the caller's :func:`sp_gather` handles it. Weight (and bias) are tagged ``tp_sharded``
    (:func:`column_parallel_weight`). ``delay_wgrad`` (``parallel.delay_wgrad``): their gradients are
    computed behind the backward's next exchange (:mod:`folding.overlap.wgrad`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group: Group,
        bias: bool = False,
        init_std: float = 0.02,
        name: str = "features",
        device=None,
        dtype=torch.float32,
        delay_wgrad: bool = False,
    ):
        super().__init__()
        self.delay_wgrad = delay_wgrad
        """Weight (and bias) gradients deferred behind the backward's next exchange."""
        kw = dict(tp_group=tp_group, name=name, device=device, dtype=dtype)
        self.weight = column_parallel_weight(in_features, out_features, init_std=init_std, **kw)
        if bias:
            tp, r = group_size(tp_group), group_rank(tp_group)
            self.bias = nn.Parameter(torch.empty(out_features // tp, device=device, dtype=dtype))
            mark_param(self.bias, tp_sharded=True)
            set_init_spec(self.bias, full_shape=(out_features,), shards=((0, r, tp),), kind="zeros")
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in] -> [..., out/TP]``."""
        return (wgrad.linear if self.delay_wgrad else F.linear)(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = x W^T`` with ``W [out, in]`` split by columns over TP; partial sums reduce-scattered.

    Input ``[S, B, in/TP]`` (full sequence); output ``[S/TP, B, out]``: forward reduce-scatter over
    TP along the sequence, backward all-gather of the gradient (:func:`row_parallel_linear`). Weight
    tagged ``tp_sharded`` (:func:`row_parallel_weight`). ``delay_wgrad``: as for
    :class:`ColumnParallelLinear`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_group: Group,
        init_std: float = 0.02,
        name: str = "features",
        device=None,
        dtype=torch.float32,
        delay_wgrad: bool = False,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.delay_wgrad = delay_wgrad
        """Weight gradient deferred behind the backward's next exchange."""
        kw = dict(tp_group=tp_group, name=name, device=device, dtype=dtype)
        self.weight = row_parallel_weight(in_features, out_features, init_std=init_std, **kw)

    def forward(self, x_SBI: torch.Tensor) -> torch.Tensor:
        """``[S, B, in/TP] -> [S/TP, B, out]``."""
        return row_parallel_linear(x_SBI, self.weight, self.tp_group, delay_wgrad=self.delay_wgrad)
