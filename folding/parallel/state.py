"""Process-group creation: the thin step from a :class:`ParallelLayout` to this rank's groups.

Every group of both views is created with ``torch.distributed.new_group`` in the same order on every
rank (a rank list that appears under several roles is created once and shared). The result is a
:class:`ParallelState`: this rank's groups named by role plus its coordinates. Nothing in ``folding``
reads groups from globals: pass the state, or the exact groups, to whoever needs them.

Usage::

    dist.init_process_group("gloo")            # or "nccl"
    layout = ParallelLayout(world_size=dist.get_world_size(), tp=2, ep=4, etp=1)
    with build_parallel_state(layout) as ps:   # destroys the groups on exit (collective)
        ps.tp_group, ps.ep_group, ps.ep_rank, ps.edp_size
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from .layout import ParallelLayout

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
)


@dataclasses.dataclass(frozen=True)
class ParallelState:
    """This rank's process groups (by role) and coordinates under a folded layout.

    ``groups[role]`` is the group handle (``None`` for roles this rank is not in, which only happens
    for ``embedding``); ``ranks[role]`` the global ranks of that group. ``<role>_group``,
    ``<role>_rank`` and ``<role>_size`` attributes give direct access.
    """

    layout: ParallelLayout
    rank: int
    groups: Dict[str, Optional[dist.ProcessGroup]]
    ranks: Dict[str, List[int]]

    def __getattr__(self, name: str):
        if name.startswith("_") or name in ("ranks", "groups", "rank", "layout"):
            raise AttributeError(name)
        for suffix, fn in (
            ("_group", lambda r: self.groups[r]),
            ("_rank", lambda r: self.ranks[r].index(self.rank)),
            ("_size", lambda r: len(self.ranks[r])),
        ):
            if name.endswith(suffix) and name[: -len(suffix)] in self.ranks:
                return fn(name[: -len(suffix)])
        raise AttributeError(name)

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
        for g in self._created:
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
        raise ValueError(f"layout is for world_size={layout.world_size} but the job has {world} ranks")
    rank = dist.get_rank()
    table = layout.groups()
    kwargs = {}
    if backend is not None:
        kwargs["backend"] = backend
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    cache: Dict[Tuple[int, ...], dist.ProcessGroup] = {}
    created = []
    groups: Dict[str, Optional[dist.ProcessGroup]] = {}
    ranks: Dict[str, List[int]] = {}
    for role, view, token in ROLES:
        for grp in table[view][token]:
            key = tuple(grp)
            if key not in cache:
                if len(key) == world:
                    handle = dist.group.WORLD
                else:
                    handle = dist.new_group(list(key), **kwargs)
                    if rank in key:
                        created.append(handle)
                cache[key] = handle
            if rank in grp:
                groups[role] = cache[key]
                ranks[role] = list(grp)
        if role not in ranks:
            groups[role] = None
            ranks[role] = []
    if world > 1:
        dist.barrier()
    state = ParallelState(layout=layout, rank=rank, groups=groups, ranks=ranks)
    object.__setattr__(state, "_created", created)
    return state
