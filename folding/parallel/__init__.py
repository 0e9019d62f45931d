"""Folded parallel layouts: pure rank math, process groups, and autograd collectives."""

from .groups import (
    Coordinates,
    GroupCoord,
    ProcessGroups,
    build_node_split_groups,
    release_shared_node_split_groups,
    shared_node_split_groups,
)
from .layout import DEFAULT_ORDER, ParallelLayout
from .rank_math import LayoutError, RankGenerator, layout_groups
from .state import ParallelState, build_parallel_state

__all__ = [
    "Coordinates",
    "DEFAULT_ORDER",
    "GroupCoord",
    "ParallelLayout",
    "LayoutError",
    "RankGenerator",
    "layout_groups",
    "ParallelState",
    "ProcessGroups",
    "build_node_split_groups",
    "build_parallel_state",
    "release_shared_node_split_groups",
    "shared_node_split_groups",
]
