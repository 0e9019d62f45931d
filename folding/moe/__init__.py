"""The MoE layer and its parts, usable on their own: configuration, router, token dispatchers (a
drop-in for Megatron-Core's), grouped experts.

Usage::

    from folding.moe import LayerSettings, MoEConfig, build_moe_layer
    layer = build_moe_layer(MoEConfig(num_experts=8, topk=2, ffn_hidden_size=14336), hidden_size=4096,
                            groups=ps.groups, settings=LayerSettings(init_seed=1))
"""

from .config import MoEConfig
from .dispatch.build import AllGatherDispatcher, AllToAllDispatcher, TokenDispatcher, build_dispatcher, dispatcher_for
from .experts.grouped import GroupedMLP
from .layer import MoELayer, SharedExpert, build_moe_layer
from .routing.functions import apply_capacity, topk_routing
from .routing.router import Router
from .settings import LayerSettings

__all__ = [
    "MoEConfig",
    "MoELayer",
    "build_moe_layer",
    "LayerSettings",
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
