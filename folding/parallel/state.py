"""Process-group creation: the thin step from a :class:`ParallelLayout` to this rank's groups.

Every group of both views is created with ``torch.distributed.new_group`` in the same order on every
rank (a rank list that appears under several roles is created once and shared). The result is a
:class:`ParallelState`: this rank's groups named by role (the typed record
:class:`~folding.parallel.groups.ProcessGroups`, ``ps.groups``) plus its coordinates. Nothing in
``folding`` reads groups from globals: pass the state, its ``groups``, or the exact groups, to whoever
needs them.

Usage::

    dist.init_process_group("gloo")            # or "nccl"
    layout = ParallelLayout(world_size=dist.get_world_size(), tp=2, ep=4, etp=1)
    with build_parallel_state(layout) as ps:   # destroys the groups on exit (collective)
        ps.groups.tp, ps.groups.ep, ps.coords.ep.rank, ps.coords.edp.size
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
from typing import Dict, Optional, Tuple

import torch.distributed as dist

from .groups import Coordinates, GroupCoord, ProcessGroups, build_node_split_groups  # noqa: F401 (re-export)
from .layout import ParallelLayout

# role (a field of ProcessGroups and Coordinates) -> (view, token) in ParallelLayout.groups()
ROLES: Tuple[Tuple[str, str, str], ...] = (
    ("tp", "attention", "tp"),
    ("cp", "attention", "cp"),
    ("dp", "attention", "dp"),
    ("dp_cp", "attention", "dp-cp"),
    ("tp_cp", "attention", "tp-cp"),
    ("tp_dp_cp", "attention", "tp-dp-cp"),
    ("pp", "attention", "pp"),
    ("embedding", "attention", "embedding"),
    ("ep", "expert", "ep"),
    ("etp", "expert", "tp"),
    ("edp", "expert", "dp"),
    ("ep_node", "expert", "ep-node"),
    ("ep_rail", "expert", "ep-rail"),
    ("ep_meta", "expert", "ep"),
)
OWN_COMMUNICATOR = ("ep_meta",)
"""Roles whose groups get a communicator of their own even where another role has the same ranks:
NCCL runs one communicator's operations in issue order, so small metadata on the EP group's own
communicator would wait behind the token payloads issued before it there."""


@dataclasses.dataclass(frozen=True)
class ParallelState:
    """This rank's process groups and its coordinates in them under a folded layout, both by role.

    ``groups.<role>`` is the group handle (the typed record modules receive) and ``coords.<role>``
    this rank's place in it (``.rank``, ``.size``, ``.ranks``), for every role of :data:`ROLES`:
    one name per group on both sides of the engine.
    """

    layout: ParallelLayout
    """The layout the groups were built from."""
    rank: int
    """This rank's global rank."""
    groups: ProcessGroups
    """The group handles by role."""
    coords: Coordinates
    """This rank's index in, size of and global ranks of its group of each role."""
    created: Tuple[dist.ProcessGroup, ...] = dataclasses.field(default=(), repr=False)
    """The groups :func:`build_parallel_state` created for this rank (:meth:`destroy` destroys them)."""

    @property
    def is_first_stage(self) -> bool:
        """True on the first pipeline stage."""
        return self.coords.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the last pipeline stage."""
        return self.coords.pp.rank == self.layout.pp - 1

    def __enter__(self) -> "ParallelState":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.destroy(sync=exc_type is None)

    def destroy(self, *, sync: Optional[bool] = None) -> None:
        """Destroy every group this state created (the world group is left alone).

        With ``sync`` this is collective over the world: a barrier first, so that no rank closes a
        group's connections while a peer still runs a collective on it. ``sync=None`` (the default)
        syncs unless an exception is propagating (``destroy`` called from a ``finally`` clause on
        an error path, where the other ranks may never arrive); pass ``True``/``False`` to decide.
        """
        if sync is None:
            sync = sys.exc_info()[0] is None
        if sync and self.layout.world_size > 1:
            dist.barrier()
        seen = set()
        for g in self.created:
            if id(g) not in seen:
                seen.add(id(g))
                dist.destroy_process_group(g)


def build_parallel_state(
    layout: ParallelLayout, *, backend: Optional[str] = None, timeout_s: Optional[float] = None
) -> ParallelState:
    """Create every group of ``layout`` (collective over the world) and return this rank's state.

    All ranks must call this with the same layout. It returns after a world barrier, so every rank
    has finished connecting every group before any rank may use or destroy one (gloo completes a
    group's connection handshake at different times on the two ends of a pair). ``backend``
    defaults to the world's backend; ``timeout_s`` sets the groups' collective timeout.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_parallel_state needs torch.distributed.init_process_group() first")
    world = dist.get_world_size()
    if world != layout.world_size:
        raise ValueError(
            f"layout is for world_size={layout.world_size} but the job has {world} rank{'' if world == 1 else 's'}"
        )
    rank, table = dist.get_rank(), layout.groups()
    kwargs = {} if backend is None else {"backend": backend}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    cache: Dict[Tuple, dist.ProcessGroup] = {}
    created, handles, coords = [], {}, {}
    for role, view, token in ROLES:
        handles[role], coords[role] = None, GroupCoord((), None)  # only `embedding` can stay so
        own = role in OWN_COMMUNICATOR
        for grp in table[view][token]:
            key = (role, *grp) if own and len(grp) > 1 else tuple(grp)  # one rank: nothing to wait on
            if key not in cache:
                cache[key] = dist.group.WORLD if len(grp) == world and not own else dist.new_group(list(grp), **kwargs)
                if rank in grp and cache[key] is not dist.group.WORLD:
                    created.append(cache[key])
            if rank in grp:
                handles[role], coords[role] = cache[key], GroupCoord(tuple(grp), list(grp).index(rank))
    if world > 1:
        dist.barrier()
    groups, coords = ProcessGroups(**handles), Coordinates(**coords)
    return ParallelState(layout=layout, rank=rank, groups=groups, coords=coords, created=tuple(created))
