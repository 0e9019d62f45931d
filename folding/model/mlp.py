"""Dense SwiGLU MLP over the attention TP group (Hugging Face ``gate_proj``/``up_proj``/``down_proj``).

``down(silu(gate(x)) * up(x))`` with gate/up column-parallel and down row-parallel; input and
output are sequence-parallel shards ``[S/TP, B, H]``. Used for dense layers (Qwen2-MoE
``mlp_only_layers`` / ``decoder_sparse_step``).

Usage::

    mlp = DenseMLP(hidden_size, ffn_hidden_size, tp_group=ps.groups.tp, init_std=0.02, output_init_std=0.005)
    y_SBH = mlp(x_SBH)
"""

from __future__ import annotations

import torch
from torch import nn

from ..moe.experts.swiglu import swiglu
from ..parallel.linear import ColumnParallelLinear, RowParallelLinear, sp_column_linears


class DenseMLP(nn.Module):
    """SwiGLU MLP ``H -> F -> H`` with F split over TP; ``name`` is the config field of F (for errors)."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        tp_group,
        init_std: float,
        output_init_std: float,
        name: str = "model.ffn_hidden_size",
        device=None,
        dtype=torch.float32,
        delay_wgrad: bool = False,
    ):
        """``delay_wgrad`` (``parallel.delay_wgrad``): the three projections' weight gradients are
        computed behind the backward's next exchange (:mod:`folding.overlap.wgrad`)."""
        super().__init__()
        self.tp_group = tp_group
        kw = dict(tp_group=tp_group, device=device, dtype=dtype, name=name, delay_wgrad=delay_wgrad)
        self.gate_proj = ColumnParallelLinear(hidden_size, ffn_hidden_size, init_std=init_std, **kw)
        self.up_proj = ColumnParallelLinear(hidden_size, ffn_hidden_size, init_std=init_std, **kw)
        self.down_proj = RowParallelLinear(ffn_hidden_size, hidden_size, init_std=output_init_std, **kw)

    def forward(self, x_SBH: torch.Tensor) -> torch.Tensor:
        """``[S/TP, B, H] -> [S/TP, B, H]``."""
        gate, up = sp_column_linears(x_SBH, (self.gate_proj, self.up_proj), self.tp_group)
        return self.down_proj(swiglu(gate, up))
