"""The MoE layer and its parts, usable on their own: configuration, router, token dispatchers (a
drop-in for Megatron-Core's), grouped experts.

Usage::

    from folding.moe import MoEConfig, MoELayer, Router, build_dispatcher
    layer = MoELayer(config=MoEConfig(num_experts=8, topk=2, ffn_hidden_size=14336), hidden_size=4096,
                     groups=ps.groups)
"""

from .config import MoEConfig
from .dispatch.build import AllGatherDispatcher, AllToAllDispatcher, TokenDispatcher, build_dispatcher, dispatcher_for
from .experts.grouped import GroupedMLP
from .layer import MoELayer, SharedExpert
from .routing.functions import apply_capacity, topk_routing
from .routing.router import Router

__all__ = [
    "MoEConfig",
    "MoELayer",
    "SharedExpert",
    "Router",
    "GroupedMLP",
    "TokenDispatcher",
    "AllToAllDispatcher",
    "AllGatherDispatcher",
    "build_dispatcher",
    "dispatcher_for",
    "topk_routing",
    "apply_capacity",
]
