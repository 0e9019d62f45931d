"""Folded parallel layouts: pure rank math, process groups, and autograd collectives."""

import importlib

_EXPORTS = {
    "Coordinates": "groups",
    "GroupCoord": "groups",
    "ProcessGroups": "groups",
    "build_node_split_groups": "groups",
    "release_shared_node_split_groups": "groups",
    "shared_node_split_groups": "groups",
    "DEFAULT_ORDER": "layout",
    "ParallelLayout": "layout",
    "LayoutError": "rank_math",
    "RankGenerator": "rank_math",
    "layout_groups": "rank_math",
    "ParallelState": "state",
    "build_parallel_state": "state",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """The package's names, each imported from its module on first use (the rank math imports no torch:
    the planner and the layout tools start without it)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
