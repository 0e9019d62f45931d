"""The process groups a rank uses, as one typed record handed whole to every module that communicates.

:class:`ProcessGroups` names each group by its role in the two views of a folded layout: the
attention view (``tp``, ``cp``, ``dp``, ``dp_cp``, ``tp_cp``, ``tp_dp_cp``, ``pp``, ``embedding``)
and the expert view (``ep``, ``etp``, ``edp``, the EP group split by node, ``ep_node`` and
``ep_rail``, and ``ep_meta`` / ``etp_meta``, the EP / ETP ranks on communicators of their own for the
token counts).
:func:`folding.parallel.build_parallel_state` builds
it once (``ps.groups``); the model, the MoE layer, its router and its dispatcher take it as one
``groups=`` argument and read the fields they use. A field left ``None`` is the default group: the
world when ``torch.distributed`` is initialized, no communication otherwise; so
``ProcessGroups.single()`` (every field ``None``) is the 1-rank record, which needs no process group.
Code embedding the engine's modules in another codebase fills in its own groups by role.

:class:`Coordinates` is the companion record with the same field names: this rank's place in each of
those groups (:class:`GroupCoord`: the group's global ranks, this rank's index, the size), built with
the groups (``ps.coords``). A role has one name on both sides: ``ps.groups.ep`` is the group,
``ps.coords.ep.rank`` and ``ps.coords.ep.size`` this rank's index in it and its size.

Usage::

    groups = ps.groups                                   # from build_parallel_state(layout)
    ps.coords.ep.rank, ps.coords.edp.size, ps.coords.pp.ranks
    groups = ProcessGroups.single()                      # 1 rank, torch.distributed not needed
    groups = ProcessGroups(ep=my_ep_group, etp=my_etp_group, tp_cp=..., tp_dp_cp=..., tp=...)
    groups.tp, groups.tp_size, groups.cp_rank
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import List, Optional, Tuple

import torch.distributed as dist

from .collectives import group_rank, group_size
from .rank_math import node_split_groups


@dataclasses.dataclass(frozen=True)
class ProcessGroups:
    """This rank's process group for every role of both views (``None``: the default group)."""

    tp: Optional[dist.ProcessGroup] = None
    """Attention tensor-parallel group (sequence parallel when its size > 1)."""
    cp: Optional[dist.ProcessGroup] = None
    """Context-parallel group."""
    dp: Optional[dist.ProcessGroup] = None
    """Attention data-parallel group."""
    dp_cp: Optional[dist.ProcessGroup] = None
    """DP x CP group: the ranks that run the same layers (dense gradient reduction, FP8 amax reduction)."""
    tp_cp: Optional[dist.ProcessGroup] = None
    """TP x CP group: the ranks holding one sequence's tokens (router aux-loss counts)."""
    tp_dp_cp: Optional[dist.ProcessGroup] = None
    """TP x DP x CP group: every token of a pipeline stage (router expert-bias counts)."""
    pp: Optional[dist.ProcessGroup] = None
    """Pipeline-parallel group."""
    embedding: Optional[dist.ProcessGroup] = None
    """First and last pipeline stage (tied embedding); ``None`` on a rank of no such group."""
    ep: Optional[dist.ProcessGroup] = None
    """Expert-parallel group."""
    etp: Optional[dist.ProcessGroup] = None
    """Expert tensor-parallel group."""
    edp: Optional[dist.ProcessGroup] = None
    """Expert data-parallel group (expert gradient reduction)."""
    ep_node: Optional[dist.ProcessGroup] = None
    """The EP group's ranks on this rank's node (``parallel.nvlink_domain``): the hierarchical
    dispatcher's second stage. ``None`` with ``ep_rail`` ``None``: the EP group is one node."""
    ep_rail: Optional[dist.ProcessGroup] = None
    """The EP group's ranks with this rank's position inside its node, one per node: the
    hierarchical dispatcher's first stage (the one that crosses nodes). ``None``: one node."""
    ep_meta: Optional[dist.ProcessGroup] = None
    """The EP group's ranks on a communicator of their own, created at start-up with the others: the
    dispatcher's token counts travel there, so that they do not wait behind the token all-to-alls
    issued before them on ``ep`` (NCCL runs one communicator's operations in issue order). Every rank
    issues its operations in the same order, as on ``ep``. ``None``: the counts use ``ep``."""
    etp_meta: Optional[dist.ProcessGroup] = None
    """The ETP group's ranks on a communicator of their own, like ``ep_meta``: the dispatcher's count
    all-gather over ETP travels there, so that it does not wait behind the other micro-batch's ETP
    payload (an all-gather or reduce-scatter of token rows) issued before it on ``etp``. ``None``: the
    counts use ``etp``."""

    @staticmethod
    def single() -> "ProcessGroups":
        """No parallelism; only valid outside a ``torch.distributed`` job of several ranks."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError(
                "torch.distributed is initialized with several ranks: pass parallel_state= "
                "(build_parallel_state(ParallelLayout(...))) to build the model"
            )
        return ProcessGroups()

    @property
    def tp_size(self) -> int:
        """Size of the attention TP group."""
        return group_size(self.tp)

    @property
    def cp_size(self) -> int:
        """Size of the CP group."""
        return group_size(self.cp)

    @property
    def cp_rank(self) -> int:
        """This rank's index in the CP group."""
        return group_rank(self.cp)


@dataclasses.dataclass(frozen=True)
class GroupCoord:
    """This rank's place in its group of one role."""

    ranks: Tuple[int, ...]
    """Global ranks of the group, in group order (empty where this rank is in no group of the role,
    which only happens for ``embedding``)."""
    rank: Optional[int]
    """This rank's index in :attr:`ranks` (``None`` where :attr:`ranks` is empty)."""

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)


@dataclasses.dataclass(frozen=True)
class Coordinates:
    """This rank's :class:`GroupCoord` for every role, named as the fields of :class:`ProcessGroups`."""

    tp: GroupCoord
    """In the attention tensor-parallel group."""
    cp: GroupCoord
    """In the context-parallel group."""
    dp: GroupCoord
    """In the attention data-parallel group."""
    dp_cp: GroupCoord
    """In the DP x CP group."""
    tp_cp: GroupCoord
    """In the TP x CP group."""
    tp_dp_cp: GroupCoord
    """In the TP x DP x CP group."""
    pp: GroupCoord
    """In the pipeline-parallel group (``rank``: the pipeline stage)."""
    embedding: GroupCoord
    """In the first-and-last-stage group (empty on the stages between)."""
    ep: GroupCoord
    """In the expert-parallel group."""
    etp: GroupCoord
    """In the expert tensor-parallel group."""
    edp: GroupCoord
    """In the expert data-parallel group."""
    ep_node: GroupCoord
    """In the EP group's ranks on this rank's node."""
    ep_rail: GroupCoord
    """In the EP group's ranks at this rank's position on every node."""
    ep_meta: GroupCoord
    """In the EP metadata group (the EP group's ranks: ``rank`` is the EP rank)."""
    etp_meta: GroupCoord
    """In the ETP metadata group (the ETP group's ranks: ``rank`` is the ETP rank)."""


def build_node_split_groups(ep_group, nvlink_domain: int):
    """Split every rank's EP group by node and return this rank's ``(node_group, rail_group)``, for
    code that holds an EP group but no :class:`ParallelState` (a Megatron-Core layer, a benchmark).

    Collective over the world: every rank calls it with its own EP group and the same
    ``nvlink_domain``; the EP groups are gathered (one small object all-gather), split by
    :func:`~folding.parallel.rank_math.node_split_groups` (which refuses uneven nodes naming
    ``parallel.nvlink_domain``) and every split group is created in the same order on every rank.
    Call it once per EP group, at start-up; the engine's own layers get the same groups from
    :func:`~folding.parallel.state.build_parallel_state` (``ps.groups.ep_node``, ``ps.groups.ep_rail``)."""
    mine = dist.get_process_group_ranks(ep_group)
    every: List[Optional[List[int]]] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    ep_groups = [list(g) for g in dict.fromkeys(tuple(g) for g in every)]
    node, rail = node_split_groups(ep_groups, nvlink_domain)
    me = dist.get_rank()
    out = {}
    for role, table in (("node", node), ("rail", rail)):
        for ranks in table:
            handle = dist.new_group(ranks)
            if me in ranks:
                out[role] = handle
    return out["node"], out["rail"]


_SHARED_SPLITS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""Per-process registry of :func:`shared_node_split_groups`, keyed by the world group (a new world,
after ``destroy_process_group`` and ``init_process_group``, starts empty): ``world -> ((EP ranks,
nvlink_domain), (node_group, rail_group))``. The one piece of module state of this package: the
dispatchers that ask for the groups are built one layer at a time by callers that hold nothing of
the engine (``replace_dispatcher`` on each Megatron-Core layer), and the groups must be created once
per process, not once per layer."""


def shared_node_split_groups(ep_group, nvlink_domain: int):
    """This rank's ``(node_group, rail_group)`` of ``ep_group`` split into nodes of ``nvlink_domain``
    ranks, built once per process (:func:`build_node_split_groups`, collective over the world) and
    returned again to every later caller that asks for the same EP group and ``nvlink_domain``, without
    any collective. So every rank creates world-wide groups exactly once, however many MoE layers
    its pipeline stage holds (stages with different numbers of layers would otherwise issue
    different numbers of world collectives and hang); every rank must ask at least once (a stage
    without MoE layers calls it too).

    A second, different request (another EP group or ``nvlink_domain``) would need a second world
    collective that other ranks may never join: it is refused with ``ValueError`` naming what was
    built and what was asked. :func:`release_shared_node_split_groups` forgets the groups."""
    want = (tuple(dist.get_process_group_ranks(ep_group)), nvlink_domain)
    world = dist.group.WORLD
    built = _SHARED_SPLITS.get(world)
    if built is None:
        groups = build_node_split_groups(ep_group, nvlink_domain)
        _SHARED_SPLITS[world] = (want, groups)
        return groups
    if built[0] != want:
        (have_ranks, have_domain), (ranks, domain) = built[0], want
        raise ValueError(
            f"nvlink_domain={domain} for EP ranks {list(ranks)}: this process already built its node and rail "
            f"groups for EP ranks {list(have_ranks)} with nvlink_domain={have_domain}, and a second set would be "
            "a collective over the world that the other ranks do not join (a hang); give every MoE layer of "
            "the process the same EP group and nvlink_domain, or build each set on every rank with "
            "folding.parallel.build_node_split_groups and pass node_group= and rail_group="
        )
    return built[1]


def release_shared_node_split_groups() -> None:
    """Destroy the groups :func:`shared_node_split_groups` built in this process, if any (those a caller
    destroyed already are only forgotten), and forget them (a later call builds again: collective over
    the world, on every rank)."""
    world = dist.group.WORLD if dist.is_initialized() else None
    built = _SHARED_SPLITS.pop(world, None) if world is not None else None
    if built is not None:
        alive = dist.distributed_c10d._world.pg_map  # a caller may have destroyed them already: forget those
        for group in built[1]:
            if group in alive:
                dist.destroy_process_group(group)


def release_process_groups() -> None:
    """Destroy the world process group and free every group object while the interpreter is alive.

    Each gloo process group owns native worker threads until its C++ object is freed, and the object
    lives as long as a Python reference does (a model's modules, the optimizer, reference cycles
    among them). A group still alive when the interpreter finalizes keeps those threads running into
    the shutdown; a thread that then releases a tensor needs the GIL, which a finalizing interpreter
    answers by ending the thread, and a C++ thread ended that way aborts the process ("terminate
    called without an active exception", SIGABRT). So: collect the cycles the caller dropped,
    destroy the groups, and collect again so that the group objects go (and their threads are
    joined) now. The caller drops its own references (the model) first.
    """
    gc.collect()
    if dist.is_initialized():
        _SHARED_SPLITS.pop(dist.group.WORLD, None)
        dist.destroy_process_group()
    gc.collect()
