"""The parallel state's two records name every role alike: ``ps.groups.<role>`` (the group) and
``ps.coords.<role>`` (this rank's place in it), one field per role of the state's build table."""

import dataclasses

import pytest
import torch.distributed as dist

from folding.parallel import ParallelLayout, build_parallel_state
from folding.parallel.groups import GroupCoord
from folding.parallel.state import ROLES, ParallelState


def test_the_state_has_no_per_role_accessors():
    """One name per group: no ``<role>_group`` / ``_rank`` / ``_size`` beside the records."""
    names = set(dir(ParallelState))
    for role, _, _ in ROLES:
        assert not {f"{role}_group", f"{role}_rank", f"{role}_size"} & names, role


def test_group_coord():
    c = GroupCoord(ranks=(4, 6, 0), rank=1)
    assert c.size == 3 and c.ranks[c.rank] == 6
    assert GroupCoord((), None).size == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.rank = 0


def test_one_rank_state(tmp_path):
    """A 1-rank gloo world: every role is this rank alone, the first and last stage."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with build_parallel_state(ParallelLayout(world_size=1)) as ps:
            for role, _, _ in ROLES:
                assert getattr(ps.coords, role) == GroupCoord((0,), 0), role
            assert ps.is_first_stage and ps.is_last_stage
    finally:
        dist.destroy_process_group()
