"""The MoE layer and its parts, usable on their own: configuration, router, token dispatchers (a
drop-in for Megatron-Core's), grouped experts.

Usage::

    from folding.moe import LayerSettings, MoEConfig, build_moe_layer
    layer = build_moe_layer(MoEConfig(num_experts=8, topk=2, ffn_hidden_size=14336), hidden_size=4096,
                            groups=ps.groups, settings=LayerSettings(init_seed=1))
"""

import importlib

_EXPORTS = {
    "MoEConfig": "config",
    "AllGatherDispatcher": "dispatch.build",
    "AllToAllDispatcher": "dispatch.build",
    "TokenDispatcher": "dispatch.build",
    "build_dispatcher": "dispatch.build",
    "dispatcher_for": "dispatch.build",
    "GroupedMLP": "experts.grouped",
    "MoELayer": "layer",
    "SharedExpert": "layer",
    "build_moe_layer": "layer",
    "apply_capacity": "routing.functions",
    "topk_routing": "routing.functions",
    "Router": "routing.router",
    "LayerSettings": "settings",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """The package's names, each imported from its module on first use (the configuration imports no
    torch: the planner and the tools that only read it start without it)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
