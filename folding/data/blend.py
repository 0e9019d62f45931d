"""Weighted blends of several datasets, and the train/valid/test split of each dataset's documents.

**Split.** ``data.split = "969,30,1"`` is normalized to fractions; every dataset of the blend cuts its
documents into three contiguous ranges ``[0, b1), [b1, b2), [b2, D)`` with ``b_k = round(D * cumsum_k)``
(like Megatron-LM, splitting by documents, never inside one).

**Blend.** A :class:`BlendedDataset` interleaves endless component streams with normalized weights
``w_d``. The stream is cut into blocks of ``M`` samples; after ``n`` blended samples (``n`` a multiple
of ``M``) component ``d`` has contributed exactly ``Q_d(n)`` samples: ``w_d * n`` rounded by largest
remainders, so ``|Q_d(n) - w_d * n| < 1`` for every component. Inside a block the ``q_d``
samples of each component are spread evenly (the block's positions are ordered by
``(k + 1/2) / q_d``). So the blend is stateless (sample ``i`` is computed from ``i`` alone, nothing
depends on history or on the layout), its proportions are exact to within one sample per component at
every block boundary, and each component is read in its own order ``0, 1, 2, ...`` so every sample of
a component's epoch is used once before any repeats.

Usage::

    ranges = split_ranges("969,30,1", num_documents=1000)   # [(0, 969), (969, 999), (999, 1000)]
    blend = BlendedDataset([ds_a, ds_b], [0.7, 0.3])
    blend[i]          # -> (component d, index within d); blend.sample(i) -> the component's sample
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split) -> List[float]:
    """``"969,30,1"`` (or a list ``[969, 30, 1]``) -> three fractions summing to 1 (missing trailing
    parts are 0).

    Raises ``ValueError`` naming ``data.split`` for a malformed or all-zero split.
    """
    if isinstance(split, (list, tuple)):
        parts = [str(p).strip() for p in split]
    else:
        parts = [p.strip() for p in str(split).replace("/", ",").split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"data.split={split!r} must be comma-separated numbers such as '969,30,1'") from None
    if not 1 <= len(values) <= 3 or any(v < 0 or not np.isfinite(v) for v in values) or sum(values) <= 0:
        raise ValueError(
            f"data.split={split!r} must be 1 to 3 non-negative numbers with a positive sum, "
            f"e.g. '969,30,1' (train, valid, test)"
        )
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def split_ranges(split: str, num_documents: int) -> List[Tuple[int, int]]:
    """Document ranges ``[(begin, end)]`` of train, valid and test for ``num_documents`` documents."""
    fractions = parse_split(split)
    bounds = [0] + [int(round(num_documents * c)) for c in np.cumsum(fractions)]
    bounds[-1] = num_documents
    return [(bounds[k], bounds[k + 1]) for k in range(3)]


def normalize_weights(weights: Sequence[float], num_paths: int) -> List[float]:
    """Blend weights normalized to sum 1, checked against the number of ``data.paths``."""
    if len(weights) != num_paths:
        raise ValueError(
            f"data.weights has {len(weights)} entries but data.paths has {num_paths}; "
            f"give one weight per path (or leave data.weights empty for equal weights)"
        )
    w = [float(x) for x in weights]
    if any(x < 0 or not np.isfinite(x) for x in w) or sum(w) <= 0:
        raise ValueError(f"data.weights={list(weights)} must be non-negative with a positive sum")
    return [x / sum(w) for x in w]


class BlendedDataset:
    """Stateless weighted interleaving of endless datasets (each supports ``ds[i]`` for ``i >= 0``).

    ``blend[i]`` is ``(component, index within the component)``; :meth:`sample` returns the sample.
    Components with weight 0 are never read.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], block_size: int = 4096):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("BlendedDataset needs one weight per dataset and at least one dataset")
        self.datasets = list(datasets)
        self.weights = np.asarray(normalize_weights(weights, len(datasets)), np.float64)
        positive = self.weights[self.weights > 0]
        self.block_size = max(int(block_size), int(np.ceil(2.0 / positive.min())))
        """Samples per block ``M`` (at least ``2 / min weight``, so every block's quotas are >= 0)."""
        self._blocks = {}

    def allocated(self, n: int) -> np.ndarray:
        """``Q_d(n)``: samples each component has contributed to the first ``n`` blended samples
        (``n`` a multiple of ``block_size``): ``w_d * n`` rounded by largest remainders."""
        exact = self.weights * float(n)
        q = np.floor(exact).astype(np.int64)
        short = n - int(q.sum())
        if short:
            # largest fractional parts first, ties to the lower index (stable sort)
            q[np.argsort(-(exact - q), kind="stable")[:short]] += 1
        return q

    def _block(self, b: int):
        if b not in self._blocks:
            m = self.block_size
            lo, hi = self.allocated(b * m), self.allocated((b + 1) * m)
            quota = hi - lo
            comp = np.repeat(np.arange(len(quota)), quota)
            local = np.arange(m, dtype=np.int64) - np.repeat(np.cumsum(quota) - quota, quota)
            key = (local + 0.5) / quota[comp]
            perm = np.lexsort((comp, key))
            comp, index = comp[perm], (lo[comp] + local)[perm]
            if len(self._blocks) >= 2:
                self._blocks.pop(min(self._blocks))
            self._blocks[b] = (comp, index)
        return self._blocks[b]

    def __getitem__(self, i: int) -> Tuple[int, int]:
        if i < 0:
            raise IndexError(f"sample index {i} must be >= 0")
        b, r = divmod(int(i), self.block_size)
        comp, index = self._block(b)
        return int(comp[r]), int(index[r])

    def sample(self, i: int):
        """The sample at blended index ``i`` (what the component returns)."""
        d, k = self[i]
        return self.datasets[d][k]
