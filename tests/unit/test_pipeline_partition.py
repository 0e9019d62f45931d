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
    assert "(last stage 1 layer)" in lay.describe()
    for kw in (dict(pp=1), dict(pp=4, vpp=2)):
        with pytest.raises(LayoutError, match="last_stage_layers"):
            ParallelLayout(world_size=32, last_stage_layers=1, **kw)


def test_first_and_last_stage_layers():
    # Qwen3-235B-A22B on PP16 (Megatron-Bridge counts the embedding and the loss as one layer each:
    # (94 + 2) / 16 = 6, so the end stages hold 5): 5, then 14 stages of 6, then 5
    stages = partition_layers(num_layers=94, pp=16, first_stage_layers=5, last_stage_layers=5)
    sizes = [e - s for s, e in stages]
    assert sizes == [5] + [6] * 14 + [5] and stages[0] == (0, 5) and stages[-1] == (89, 94)
    assert all(a[1] == b[0] for a, b in zip(stages, stages[1:]))  # contiguous, in order
    # first alone: 1, then 3 stages of 3
    assert partition_layers(num_layers=10, pp=4, first_stage_layers=1) == [(0, 1), (1, 4), (4, 7), (7, 10)]
    # two stages, both given: they must cover the model exactly
    assert partition_layers(num_layers=4, pp=2, first_stage_layers=1, last_stage_layers=3) == [(0, 1), (1, 4)]
    for kw in (
        dict(pp=16, first_stage_layers=5, last_stage_layers=4),  # 85 over 14 stages
        dict(pp=2, first_stage_layers=1, last_stage_layers=1),  # 92 layers left for no stage
        dict(pp=4, vpp=2, first_stage_layers=1),
        dict(pp=1, first_stage_layers=1),
        dict(pp=4, first_stage_layers=0),
    ):
        with pytest.raises(ValueError, match="first_stage_layers"):
            partition_layers(num_layers=94, **kw)
    from folding.parallel import LayoutError, ParallelLayout

    lay = ParallelLayout(world_size=256, tp=4, cp=2, pp=16, first_stage_layers=5, last_stage_layers=5, ep=8, etp=1)
    assert "(first stage 5 layers, last stage 5 layers)" in lay.describe()
    with pytest.raises(LayoutError, match="first_stage_layers"):
        ParallelLayout(world_size=32, pp=4, vpp=2, first_stage_layers=1)
