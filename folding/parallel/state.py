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
        ps.tp_group, ps.ep_group, ps.ep_rank, ps.edp_size, ps.groups
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from .groups import ProcessGroups
from .layout import ParallelLayout
from .rank_math import node_split_groups

# role name on ParallelState -> (view, token)
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
    """This rank's process groups (by role) and coordinates under a folded layout.

    ``groups`` is the typed record of the group handles, what modules receive; ``ranks[role]`` the
    global ranks of this rank's group of each role (empty, with a ``None`` group, for roles this rank
    is not in, which only happens for ``embedding``). ``<role>_group``, ``<role>_rank`` and
    ``<role>_size`` give direct access for every role of :data:`ROLES`.
    """

    layout: ParallelLayout
    """The layout the groups were built from."""
    rank: int
    """This rank's global rank."""
    groups: ProcessGroups
    """The group handles by role."""
    ranks: Dict[str, List[int]]
    """Role name -> global ranks of this rank's group of that role."""
    created: Tuple[dist.ProcessGroup, ...] = dataclasses.field(default=(), repr=False)
    """The groups :func:`build_parallel_state` created for this rank (:meth:`destroy` destroys them)."""

    @property
    def tp_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's attention tensor-parallel group."""
        return self.groups.tp

    @property
    def tp_rank(self) -> int:
        """This rank's index in its attention tensor-parallel group."""
        return self.ranks["tp"].index(self.rank)

    @property
    def tp_size(self) -> int:
        """Size of this rank's attention tensor-parallel group."""
        return len(self.ranks["tp"])

    @property
    def cp_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's context-parallel group."""
        return self.groups.cp

    @property
    def cp_rank(self) -> int:
        """This rank's index in its context-parallel group."""
        return self.ranks["cp"].index(self.rank)

    @property
    def cp_size(self) -> int:
        """Size of this rank's context-parallel group."""
        return len(self.ranks["cp"])

    @property
    def dp_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's attention data-parallel group."""
        return self.groups.dp

    @property
    def dp_rank(self) -> int:
        """This rank's index in its attention data-parallel group."""
        return self.ranks["dp"].index(self.rank)

    @property
    def dp_size(self) -> int:
        """Size of this rank's attention data-parallel group."""
        return len(self.ranks["dp"])

    @property
    def dp_cp_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's DP x CP group."""
        return self.groups.dp_cp

    @property
    def dp_cp_rank(self) -> int:
        """This rank's index in its DP x CP group."""
        return self.ranks["dp_cp"].index(self.rank)

    @property
    def dp_cp_size(self) -> int:
        """Size of this rank's DP x CP group."""
        return len(self.ranks["dp_cp"])

    @property
    def tp_cp_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's TP x CP group."""
        return self.groups.tp_cp

    @property
    def tp_cp_rank(self) -> int:
        """This rank's index in its TP x CP group."""
        return self.ranks["tp_cp"].index(self.rank)

    @property
    def tp_cp_size(self) -> int:
        """Size of this rank's TP x CP group."""
        return len(self.ranks["tp_cp"])

    @property
    def tp_dp_cp_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's TP x DP x CP group."""
        return self.groups.tp_dp_cp

    @property
    def tp_dp_cp_rank(self) -> int:
        """This rank's index in its TP x DP x CP group."""
        return self.ranks["tp_dp_cp"].index(self.rank)

    @property
    def tp_dp_cp_size(self) -> int:
        """Size of this rank's TP x DP x CP group."""
        return len(self.ranks["tp_dp_cp"])

    @property
    def pp_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's pipeline-parallel group."""
        return self.groups.pp

    @property
    def pp_rank(self) -> int:
        """This rank's index in its pipeline-parallel group."""
        return self.ranks["pp"].index(self.rank)

    @property
    def pp_size(self) -> int:
        """Size of this rank's pipeline-parallel group."""
        return len(self.ranks["pp"])

    @property
    def embedding_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's embedding (first and last pipeline stage) group."""
        return self.groups.embedding

    @property
    def embedding_rank(self) -> int:
        """This rank's index in its embedding (first and last pipeline stage) group."""
        return self.ranks["embedding"].index(self.rank)

    @property
    def embedding_size(self) -> int:
        """Size of this rank's embedding (first and last pipeline stage) group."""
        return len(self.ranks["embedding"])

    @property
    def ep_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's expert-parallel group."""
        return self.groups.ep

    @property
    def ep_rank(self) -> int:
        """This rank's index in its expert-parallel group."""
        return self.ranks["ep"].index(self.rank)

    @property
    def ep_size(self) -> int:
        """Size of this rank's expert-parallel group."""
        return len(self.ranks["ep"])

    @property
    def etp_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's expert tensor-parallel group."""
        return self.groups.etp

    @property
    def etp_rank(self) -> int:
        """This rank's index in its expert tensor-parallel group."""
        return self.ranks["etp"].index(self.rank)

    @property
    def etp_size(self) -> int:
        """Size of this rank's expert tensor-parallel group."""
        return len(self.ranks["etp"])

    @property
    def edp_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's expert data-parallel group."""
        return self.groups.edp

    @property
    def edp_rank(self) -> int:
        """This rank's index in its expert data-parallel group."""
        return self.ranks["edp"].index(self.rank)

    @property
    def edp_size(self) -> int:
        """Size of this rank's expert data-parallel group."""
        return len(self.ranks["edp"])

    @property
    def ep_node_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's group of its node (the EP ranks on its node)."""
        return self.groups.ep_node

    @property
    def ep_node_rank(self) -> int:
        """This rank's index in its group of its node (the EP ranks on its node)."""
        return self.ranks["ep_node"].index(self.rank)

    @property
    def ep_node_size(self) -> int:
        """Size of this rank's group of its node (the EP ranks on its node)."""
        return len(self.ranks["ep_node"])

    @property
    def ep_rail_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's group of its rail (the EP ranks at its position on every node)."""
        return self.groups.ep_rail

    @property
    def ep_rail_rank(self) -> int:
        """This rank's index in its group of its rail (the EP ranks at its position on every node)."""
        return self.ranks["ep_rail"].index(self.rank)

    @property
    def ep_rail_size(self) -> int:
        """Size of this rank's group of its rail (the EP ranks at its position on every node)."""
        return len(self.ranks["ep_rail"])

    @property
    def ep_meta_group(self) -> Optional[dist.ProcessGroup]:
        """This rank's EP ranks on their own communicator (small metadata: the dispatcher's counts)."""
        return self.groups.ep_meta

    @property
    def ep_meta_rank(self) -> int:
        """This rank's index in its EP metadata group (its EP rank)."""
        return self.ranks["ep_meta"].index(self.rank)

    @property
    def ep_meta_size(self) -> int:
        """Size of this rank's EP metadata group (the EP size)."""
        return len(self.ranks["ep_meta"])

    @property
    def is_first_stage(self) -> bool:
        """True on the first pipeline stage."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the last pipeline stage."""
        return self.pp_rank == self.layout.pp - 1

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
    rank = dist.get_rank()
    table = layout.groups()
    kwargs = {}
    if backend is not None:
        kwargs["backend"] = backend
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    cache: Dict[Tuple[int, ...], dist.ProcessGroup] = {}
    created = []
    handles: Dict[str, Optional[dist.ProcessGroup]] = {}
    ranks: Dict[str, List[int]] = {}
    for role, view, token in ROLES:
        for grp in table[view][token]:
            key = tuple(grp)
            if role in OWN_COMMUNICATOR and len(key) > 1:
                key = (role, *key)  # a new communicator over the same ranks (one rank: nothing to wait on)
            if key not in cache:
                if len(grp) == world and role not in OWN_COMMUNICATOR:
                    handle = dist.group.WORLD
                else:
                    handle = dist.new_group(list(grp), **kwargs)
                    if rank in grp:
                        created.append(handle)
                cache[key] = handle
            if rank in grp:
                handles[role] = cache[key]
                ranks[role] = list(grp)
        if role not in ranks:
            handles[role] = None
            ranks[role] = []
    if world > 1:
        dist.barrier()
    return ParallelState(layout=layout, rank=rank, groups=ProcessGroups(**handles), ranks=ranks, created=tuple(created))


def build_node_split_groups(ep_group, nvlink_domain: int):
    """Split every rank's EP group by node and return this rank's ``(node_group, rail_group)``, for
    code that holds an EP group but no :class:`ParallelState` (a Megatron-Core layer, a benchmark).

    Collective over the world: every rank calls it with its own EP group and the same
    ``nvlink_domain``; the EP groups are gathered (one small object all-gather), split by
    :func:`~folding.parallel.rank_math.node_split_groups` (which refuses uneven nodes naming
    ``parallel.nvlink_domain``) and every split group is created in the same order on every rank.
    Call it once per EP group, at start-up; the engine's own layers get the same groups from
    :func:`build_parallel_state` (``ps.ep_node_group``, ``ps.ep_rail_group``)."""
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
