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
