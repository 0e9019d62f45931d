"""What a training step reads from and updates on the MoE routers of a model, and how it finds them.

:class:`BalancingRouter` is the interface: the statistics of the last forward (rows per expert after
capacity, dropped (token, expert) pairs, this rank's share of each router loss), the gradient weight
of the router losses, and the updates due once per global batch (the aux-loss-free expert bias, the
token counts of ``global_aux_loss``). :class:`folding.moe.routing.router.Router` implements it;
:func:`find_routers` returns every implementation inside a model (or a model's pipeline chunks).

Shape legend: E (global) experts.

Usage::

    routers = find_routers(chunks)
    for r in routers:
        r.aux_loss_scale = 1.0 / num_microbatches
    ...                                                    # after the global batch's last backward
    update_expert_biases([r for r in routers if r.has_expert_bias], group=...)   # folding.optim
    for r in routers:
        if r.accumulates_global_aux_loss:
            r.reset_global_aux_loss()
"""

from __future__ import annotations

import abc
from typing import Dict, Iterable, List, Optional, Union

import torch
from torch import nn


class BalancingRouter(nn.Module, abc.ABC):
    """A router module as a training step sees it (see the module docstring)."""

    layer_number: int
    """Global number of the MoE layer the router belongs to."""
    aux_loss_scale: Union[float, torch.Tensor]
    """Gradient given to each router loss: the objective gains ``aux_loss_scale · loss`` per forward."""
    last_tokens_per_expert: Optional[torch.Tensor]
    """Rows per expert ``[E]`` after capacity (this rank's tokens) of the last forward."""
    last_dropped: Optional[torch.Tensor]
    """Routed (token, expert) pairs dropped by capacity in the last forward (this rank, a scalar)."""
    last_dropped_per_expert: Optional[torch.Tensor]
    """``[E]``: the pairs of :attr:`last_dropped` by the expert they were routed to."""
    last_losses: Dict[str, torch.Tensor]
    """This rank's share of each router loss of the last forward, by loss type (detached)."""

    @property
    @abc.abstractmethod
    def has_expert_bias(self) -> bool:
        """True when the router selects experts with an aux-loss-free expert bias."""

    @abc.abstractmethod
    def expert_demand(self) -> torch.Tensor:
        """Tokens this rank routed to each expert ``[E]`` (before capacity) since the last
        :meth:`update_expert_bias`; only with :attr:`has_expert_bias`."""

    @abc.abstractmethod
    def update_expert_bias(self, demand_E: torch.Tensor) -> None:
        """Move the expert bias by the demand ``demand_E`` summed over every rank that routes distinct
        tokens, and restart :meth:`expert_demand` from zero; only with :attr:`has_expert_bias`."""

    @property
    @abc.abstractmethod
    def accumulates_global_aux_loss(self) -> bool:
        """True when the router's loss accumulates token counts over the global batch
        (``global_aux_loss``): call :meth:`reset_global_aux_loss` once per global batch."""

    @abc.abstractmethod
    def reset_global_aux_loss(self) -> None:
        """Forget the token counts accumulated for ``global_aux_loss``."""


def find_routers(modules: Iterable[nn.Module]) -> List[BalancingRouter]:
    """Every :class:`BalancingRouter` inside ``modules`` (models or pipeline chunks), in module order."""
    return [m for module in modules for m in module.modules() if isinstance(m, BalancingRouter)]
