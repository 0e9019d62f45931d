"""Process-group creation: the thin step from a :class:`ParallelLayout` to this rank's groups.

Every group of both views is created with ``torch.distributed.new_group`` in the same order on every
rank. A rank list that appears under several roles is created once and shared, except where that would
put work that must not wait behind another's on one NCCL queue: the dispatchers' count groups always
(:data:`OWN_COMMUNICATOR`), and with ``own_communicators`` every role that overlap pairs use
(:data:`CONCURRENT_ROLES`; :func:`communicator_keys` is the rule as pure rank math). The result is a
:class:`ParallelState`: this rank's groups named by role (the typed record
:class:`~folding.parallel.groups.ProcessGroups`, ``ps.groups``) plus its coordinates. Nothing in
``folding`` reads groups from globals: pass the state, its ``groups``, or the exact groups, to whoever
needs them.

Usage::

    dist.init_process_group("gloo")            # or "nccl"
    layout = ParallelLayout(world_size=dist.get_world_size(), tp=2, ep=4, etp=1)
    with build_parallel_state(layout) as ps:   # destroys the groups on exit (collective)
        ps.groups.tp, ps.groups.ep, ps.coords.ep.rank, ps.coords.edp.size
    ps = build_parallel_state(layout, own_communicators=True)   # with parallel.overlap_moe_comm
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
from types import MappingProxyType
from typing import Dict, List, Mapping, Optional, Tuple

import torch.distributed as dist

from .groups import Coordinates, GroupCoord, ProcessGroups, build_node_split_groups  # noqa: F401 (re-export)
from .layout import ParallelLayout

CommKey = Tuple[str, Tuple[int, ...]]
"""A communicator's key in :func:`communicator_keys`: ``(queue, ranks)``."""

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
    ("etp_meta", "expert", "tp"),
)
OWN_COMMUNICATOR = ("ep_meta", "etp_meta")
"""Roles whose groups always get a communicator of their own, even where another role has the same ranks:
NCCL runs one communicator's operations in issue order, so the dispatchers' small token counts on the
EP or ETP communicator would wait behind the token payloads issued before them there."""

CONCURRENT_ROLES: Mapping[str, str] = MappingProxyType(
    {
        # the token payloads: the EP all-to-all, or the hierarchical dispatcher's rail and node stages
        "ep": "ep",
        "ep_node": "ep",
        "ep_rail": "ep",
        # the ETP all-gather / reduce-scatter of token rows
        "etp": "etp",
        # the dispatchers' token counts (always on communicators of their own: OWN_COMMUNICATOR)
        "ep_meta": "ep_meta",
        "etp_meta": "etp_meta",
        # the all-reduce of sequence-parallel gradients that a backward launches and leaves in flight
        "tp": "tp",
        # the gradient reductions a backward launches, in the reducer's one bucket order, waited together
        # at the step's end; dp's token count runs before the step's first forward, when none is in flight
        "dp": "grads",
        "dp_cp": "grads",
        "edp": "grads",
        "embedding": "grads",
    }
)
"""With ``own_communicators`` (``parallel.overlap_moe_comm``): the *queue* of every role whose collectives
can be in flight while the other lane of an overlap pair runs: issued with ``async_op=True`` (on the
communicator's own stream, ordered by nothing but the communicator) and waited for after a hand-over.
NCCL runs one communicator's operations in issue order, so any role whose ranks equal such a role's
would queue behind that work: the other micro-batch's TP gathers, router all-reduces and shared-expert
collectives behind a token all-to-all, the next exchange behind a gradient reduction launched in a
backward.

Roles of different queues never share a communicator; roles of one queue share one where their ranks
match, because their order on it is fixed by the program and costs them nothing:

- ``ep`` (``ep``, ``ep_node``, ``ep_rail``): the token payloads of both lanes cross the same links in
  the baton's order anyway. Two of them have the same ranks only where one carries no payload (one
  node: ``ep_node`` is ``ep`` and the ``alltoall`` exchange is used) or where the rail carries it all
  (one EP rank per node: ``ep_rail`` is ``ep``).
- ``etp``, ``tp``, ``ep_meta``, ``etp_meta``: a queue each. ``tp`` carries the all-reduce of the
  sequence-parallel (TP-replicated) gradients that a backward's bucket launch leaves in flight.
- ``grads`` (``dp_cp``, ``edp``, ``embedding``, ``dp``): the reducer launches its buckets in one fixed
  order and waits for them together at the step's end; on one queue each is still done by then.
  ``dp`` carries only the step's token count, before the first forward, when no reduction is in flight.

The roles not listed (``cp``, ``tp_cp``, ``tp_dp_cp``, ``pp``) issue only blocking collectives, which
run on the compute stream that both lanes share (or, for ``pp``, between pairs): they are ordered by
that stream already, so they share with each other and with the world group as without the rule, never
with a listed role. Every extra communicator costs device memory on NCCL: buffers per channel and per
peer it connects to (``NCCL_BUFFSIZE``, 4 MiB by default, for the simple protocol), tens to a few hundred
MB per communicator (``docs/training.md``, "A communicator per concurrent role", has the counts)."""


def communicator_keys(
    layout: ParallelLayout, own_communicators: bool = False
) -> Dict[str, List[Tuple[Tuple[int, ...], CommKey]]]:
    """Which groups share a communicator, as pure rank math: per role, ``(ranks, key)`` for each of its
    groups in ``layout.groups()``'s order. Groups with equal keys are one communicator; a key is
    ``(queue, ranks)``, ``queue`` the empty string for a group that shares with every role of its ranks.

    Without ``own_communicators``: groups share by ranks, except the roles of :data:`OWN_COMMUNICATOR`.
    With it: each role of :data:`CONCURRENT_ROLES` also gets its queue's communicator. A group of one
    rank always shares (it never communicates). A shared group of the whole world is the world group.
    Worked example, TP2 EP2 ETP1 on 2 ranks: ``tp``, ``tp_cp``, ``tp_dp_cp``, ``ep`` and ``ep_node`` are
    ``[0, 1]``; without the rule all five have the key ``("", (0, 1))`` (the world group), with it ``tp``
    has ``("tp", (0, 1))``, ``ep`` and ``ep_node`` ``("ep", (0, 1))``, and ``tp_cp`` and ``tp_dp_cp`` keep
    ``("", (0, 1))``; ``ep_meta`` has ``("ep_meta", (0, 1))`` either way.
    """
    table = layout.groups()
    out: Dict[str, List[Tuple[Tuple[int, ...], CommKey]]] = {}
    for role, view, token in ROLES:
        queue = role if role in OWN_COMMUNICATOR else (CONCURRENT_ROLES.get(role, "") if own_communicators else "")
        out[role] = [(tuple(g), (queue if len(g) > 1 else "", tuple(g))) for g in table[view][token]]
    return out


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
    layout: ParallelLayout,
    *,
    backend: Optional[str] = None,
    timeout_s: Optional[float] = None,
    own_communicators: bool = False,
) -> ParallelState:
    """Create every group of ``layout`` (collective over the world) and return this rank's state.

    All ranks must call this with the same layout. It returns after a world barrier, so every rank
    has finished connecting every group before any rank may use or destroy one (gloo completes a
    group's connection handshake at different times on the two ends of a pair). ``backend``
    defaults to the world's backend; ``timeout_s`` sets the groups' collective timeout.
    ``own_communicators`` (the trainer passes ``parallel.overlap_moe_comm``): every role of
    :data:`CONCURRENT_ROLES` gets a communicator of its own even where another role has the same ranks
    (:func:`communicator_keys` says which groups share); without it roles with the same ranks share one.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_parallel_state needs torch.distributed.init_process_group() first")
    world = dist.get_world_size()
    if world != layout.world_size:
        raise ValueError(
            f"layout is for world_size={layout.world_size} but the job has {world} rank{'' if world == 1 else 's'}"
        )
    rank = dist.get_rank()
    kwargs = {} if backend is None else {"backend": backend}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    cache: Dict[CommKey, dist.ProcessGroup] = {}
    created, handles, coords = [], {}, {}
    for role, groups in communicator_keys(layout, own_communicators).items():
        handles[role], coords[role] = None, GroupCoord((), None)  # only `embedding` can stay so
        for grp, key in groups:
            if key not in cache:  # every rank creates every group, in the same order
                world_group = len(grp) == world and not key[0]
                cache[key] = dist.group.WORLD if world_group else dist.new_group(list(grp), **kwargs)
                if rank in grp and not world_group:
                    created.append(cache[key])
            if rank in grp:
                handles[role], coords[role] = cache[key], GroupCoord(grp, grp.index(rank))
    if world > 1:
        dist.barrier()
    groups, coords = ProcessGroups(**handles), Coordinates(**coords)
    return ParallelState(layout=layout, rank=rank, groups=groups, coords=coords, created=tuple(created))
