"""Stage partitioning: even splits, uneven first/last stages, and clear errors."""

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


def test_uneven_first_last():
    # 30 layers, first and last stage get 6, the two middle stages 9 each
    assert partition_layers(num_layers=30, pp=4, first_stage_layers=6, last_stage_layers=6) == [
        (0, 6),
        (6, 15),
        (15, 24),
        (24, 30),
    ]
    assert partition_layers(num_layers=7, pp=2, first_stage_layers=3) == [(0, 3), (3, 7)]


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(num_layers=7, pp=2), "cannot be split evenly"),
        (dict(num_layers=4, pp=2, vpp=4), "cannot be split evenly"),
        (dict(num_layers=4, pp=2, first_stage_layers=5), "exceed"),
        (dict(num_layers=4, pp=2, first_stage_layers=4), "at least one layer"),
    ],
)
def test_errors(kw, needle):
    with pytest.raises(ValueError, match=needle):
        partition_layers(**kw)
