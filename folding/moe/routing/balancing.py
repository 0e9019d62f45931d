"""What a training step reads from and updates on the MoE routers of a model, and how it finds them.

:class:`BalancingRouter` is the interface: the statistics of the last forward (rows per expert after
capacity, dropped (token, expert) pairs, this rank's share of each router loss), the gradient weight
of the router losses, and the updates due once per global batch (the aux-loss-free expert bias, the
token counts of ``global_aux_loss``). :class:`folding.moe.routing.router.Router` implements it;
:func:`find_routers` returns every implementation inside a model (or a model's pipeline chunks).

Shape legend: E (global) experts.

Usage::

    routers = find_routers(chunks)                         # built with their aux_loss_scale
    ...                                                    # after the global batch's last backward
    update_expert_biases([r for r in routers if r.has_expert_bias], group=...)   # folding.optim
    for r in routers:
        if r.accumulates_global_aux_loss:
            r.reset_global_aux_loss()
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Iterable, List, Mapping, Optional, Union

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class RoutingStats:
    """Routing statistics of one router forward, or the sum of several forwards of one layer (detached)."""

    layer_number: int
    """Global number of the MoE layer that routed."""
    tokens_per_expert_E: torch.Tensor
    """Rows per expert ``[E]`` after capacity (this rank's tokens)."""
    dropped_per_expert_E: torch.Tensor
    """``[E]``: routed (token, expert) pairs dropped by capacity, by the expert they were routed to."""
    losses: Mapping[str, torch.Tensor]
    """This rank's share of each router loss, by loss type (detached; summed over the loss's group it
    is the loss of the micro-batch). A sum of forwards holds float64 sums."""

    @property
    def dropped(self) -> torch.Tensor:
        """Dropped (token, expert) pairs of every expert (a scalar)."""
        return self.dropped_per_expert_E.sum()

    def __add__(self, other: "RoutingStats") -> "RoutingStats":
        """The statistics of both (the same layer): counts added, losses added as float64."""
        if other.layer_number != self.layer_number:
            raise ValueError(f"cannot add the routing of layer {other.layer_number} to layer {self.layer_number}'s")
        names = list(self.losses) + [k for k in other.losses if k not in self.losses]
        losses = {k: sum(s.losses[k].to(torch.float64) for s in (self, other) if k in s.losses) for k in names}
        return RoutingStats(
            layer_number=self.layer_number,
            tokens_per_expert_E=self.tokens_per_expert_E + other.tokens_per_expert_E,
            dropped_per_expert_E=self.dropped_per_expert_E + other.dropped_per_expert_E,
            losses=losses,
        )


class RoutedBlock(abc.ABC):
    """A module whose forwards route tokens and keep their :class:`RoutingStats` for the step."""

    @abc.abstractmethod
    def take_routing_stats(self) -> Optional[RoutingStats]:
        """The sum of the routing statistics of the training forwards since the last call (``None``
        if there were none), and forget them."""


def find_routed_blocks(modules: Iterable[nn.Module]) -> List[RoutedBlock]:
    """Every :class:`RoutedBlock` inside ``modules`` (models or pipeline chunks), in module order."""
    return [m for module in modules for m in module.modules() if isinstance(m, RoutedBlock)]


class BalancingRouter(nn.Module, abc.ABC):
    """A router module as a training step sees it (see the module docstring)."""

    layer_number: int
    """Global number of the MoE layer the router belongs to."""
    aux_loss_scale: Union[float, torch.Tensor]
    """Gradient given to each router loss: the objective gains ``aux_loss_scale · loss`` per forward."""

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
