"""Stage partitioning: even splits over virtual stages, and clear errors."""

import pytest

from folding.parallel.partition import layers_of, partition_layers


def test_even_and_virtual():
    assert partition_layers(num_layers=8, pp=1) == [(0, 8)]
    assert partition_layers(num_layers=8, pp=4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    st = partition_layers(num_layers=8, pp=2, vpp=2)
    assert st == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # rank 1 holds virtual stages 1 and 3
    assert list(layers_of(rank=1, chunk=0, pp=2, stages=st)) == [2, 3]
    assert list(layers_of(rank=1, chunk=1, pp=2, stages=st)) == [6, 7]


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(num_layers=7, pp=2), "cannot be split evenly"),
        (dict(num_layers=4, pp=2, vpp=4), "cannot be split evenly"),
        (dict(num_layers=3, pp=4), "parallel.pp=4"),
    ],
)
def test_errors(kw, needle):
    with pytest.raises(ValueError, match=needle):
        partition_layers(**kw)


def test_last_stage_layers_uneven_split():
    # DeepSeek-V3 on PP16 (Megatron-Bridge's layout): 61 = 15 stages of 4, then 1
    stages = partition_layers(num_layers=61, pp=16, last_stage_layers=1)
    assert stages[:2] == [(0, 4), (4, 8)] and stages[-2:] == [(56, 60), (60, 61)] and len(stages) == 16
    assert partition_layers(num_layers=4, pp=2, last_stage_layers=1) == [(0, 3), (3, 4)]
    for kw in (
        dict(pp=16, last_stage_layers=2),
        dict(pp=1, last_stage_layers=1),
        dict(pp=4, vpp=2, last_stage_layers=1),
    ):
        with pytest.raises(ValueError, match="last_stage_layers"):
            partition_layers(num_layers=61, **kw)


def test_last_stage_layers_layout_checks():
    from folding.parallel import LayoutError, ParallelLayout

    lay = ParallelLayout(world_size=32, tp=2, pp=16, last_stage_layers=1)
    assert "(last stage 1 layers)" in lay.describe()
    for kw in (dict(pp=1), dict(pp=4, vpp=2)):
        with pytest.raises(LayoutError, match="last_stage_layers"):
            ParallelLayout(world_size=32, last_stage_layers=1, **kw)
