"""Global batches split by the attention data-parallel rank, as micro-batches, with exact resume.

Step ``s`` consumes global samples ``[s*GBS, (s+1)*GBS)`` of the (blended) dataset, whatever the
layout. Attention DP rank ``r`` of ``DP`` gets the contiguous block
``[s*GBS + r*GBS/DP, s*GBS + (r+1)*GBS/DP)``, cut into ``GBS/(DP*MBS)`` micro-batches of ``MBS``
samples in order. Ranks that share a DP rank (TP, CP, and therefore every EP/ETP peer folded over
them) read the same samples; EP never splits data. Over ``N`` consecutive samples (one epoch of a
single dataset) every sample is consumed exactly once across the DP ranks.

The state is the number of global samples consumed before the current step plus the number of
micro-batches already returned in it: :meth:`MicroBatchIterator.state_dict` /
:meth:`~MicroBatchIterator.load_state_dict` restore it exactly. A state saved at a step boundary can
be loaded under another DP size, micro-batch size or global batch size (the stream position is
global); a mid-step state only under the same ``(GBS, MBS, DP)``.

Each micro-batch is a dict of CPU tensors, ``[MBS, seq_length]`` unless noted:

- ``tokens`` (int64): sample tokens ``0..S-1``; ``labels`` (int64): tokens ``1..S``;
- ``loss_mask`` (float32): 1 where the label is a real token, 0 on padding (the short last sample of
  an epoch) and, with ``eod_mask_loss``, where the *input* is EOD (predicting across documents);
- ``sample_index`` (int64, ``[MBS]``): the global index of each sample in the stream;
- ``dataset_index`` / ``dataset_sample`` (int64, ``[MBS]``): blend component and index within it.

Usage::

    it = MicroBatchIterator(blend, global_batch_size=8, micro_batch_size=2, dp_rank=ps.coords.dp.rank,
                            dp_size=layout.dp, seq_length=128, eod=tok.eod)
    for _ in range(it.num_micro_batches):
        mb = next(it)
    state = it.state_dict()
"""

from __future__ import annotations

import numbers
from typing import Dict, Iterator

import numpy as np
import torch

from .blend import BlendedDataset


def check_batch_sizes(global_batch_size: int, micro_batch_size: int, dp_size: int, dp_rank: int) -> None:
    """Raise ``ValueError`` naming the argument unless ``GBS`` is a multiple of ``MBS * DP``."""
    for name, v in (
        ("global_batch_size", global_batch_size),
        ("micro_batch_size", micro_batch_size),
        ("dp_size", dp_size),
    ):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"{name}={v!r} must be an integer >= 1")
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, numbers.Integral) or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank!r} must be in [0, dp_size={dp_size})")
    if global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by micro_batch_size*dp = "
            f"{micro_batch_size}*{dp_size}; choose a global batch size that is a multiple of "
            f"{micro_batch_size * dp_size}"
        )


class MicroBatchIterator(Iterator[Dict[str, torch.Tensor]]):
    """Endless iterator over this DP rank's micro-batches of successive global batches."""

    def __init__(
        self,
        dataset,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seq_length: int,
        eod: int,
        eod_mask_loss: bool = False,
        consumed_samples: int = 0,
    ):
        check_batch_sizes(global_batch_size, micro_batch_size, dp_size, dp_rank)
        parts = dataset.datasets if isinstance(dataset, BlendedDataset) else [dataset]
        for part in parts:
            if getattr(part, "seq_length", seq_length) != seq_length:
                raise ValueError(
                    f"seq_length={seq_length} differs from the dataset's seq_length="
                    f"{part.seq_length}; build the dataset with the same sequence length"
                )
        self.dataset = dataset
        self.global_batch_size = int(global_batch_size)
        self.micro_batch_size = int(micro_batch_size)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.seq_length = seq_length
        self.eod = eod
        self.eod_mask_loss = eod_mask_loss
        self.consumed_samples = int(consumed_samples)
        """Global samples consumed by the steps before the current one."""
        self.micro_batch = 0
        """Micro-batches of the current step already returned by this rank."""

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per step on each DP rank: ``GBS / (DP * MBS)``."""
        return self.global_batch_size // (self.dp_size * self.micro_batch_size)

    def indices(self, step_start: int, micro_batch: int) -> range:
        """Global sample indices of micro-batch ``micro_batch`` of the step starting at ``step_start``."""
        base = step_start + self.dp_rank * (self.global_batch_size // self.dp_size)
        lo = base + micro_batch * self.micro_batch_size
        return range(lo, lo + self.micro_batch_size)

    def __next__(self) -> Dict[str, torch.Tensor]:
        idx = self.indices(self.consumed_samples, self.micro_batch)
        batch = self.collate(idx)
        self.micro_batch += 1
        if self.micro_batch == self.num_micro_batches:
            self.micro_batch = 0
            self.consumed_samples += self.global_batch_size
        return batch

    def collate(self, indices) -> Dict[str, torch.Tensor]:
        """Build the micro-batch dict (see the module docstring) for global ``indices``."""
        s = self.seq_length
        n = len(indices)
        data = np.empty((n, s + 1), np.int64)
        real = np.empty(n, np.int64)
        comp = np.zeros(n, np.int64)
        within = np.empty(n, np.int64)
        for row, i in enumerate(indices):
            if isinstance(self.dataset, BlendedDataset):
                comp[row], within[row] = self.dataset[i]
                data[row], real[row] = self.dataset.datasets[comp[row]][within[row]]
            else:
                within[row] = i
                data[row], real[row] = self.dataset[i]
        tokens = torch.from_numpy(data[:, :-1].copy())
        labels = torch.from_numpy(data[:, 1:].copy())
        mask = torch.arange(s).unsqueeze(0) < torch.from_numpy(real - 1).unsqueeze(1)
        if self.eod_mask_loss:
            mask &= tokens != self.eod
        return {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": mask.to(torch.float32),
            "sample_index": torch.tensor(list(indices), dtype=torch.int64),
            "dataset_index": torch.from_numpy(comp),
            "dataset_sample": torch.from_numpy(within),
        }

    def state_dict(self) -> Dict[str, int]:
        """The exact position: ``{"consumed_samples", "micro_batch", "global_batch_size",
        "micro_batch_size", "dp_size"}`` (plain ints)."""
        return {
            "consumed_samples": self.consumed_samples,
            "micro_batch": self.micro_batch,
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "dp_size": self.dp_size,
        }

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Restore a position saved by :meth:`state_dict` (see the module docstring for what may change)."""
        micro = int(state.get("micro_batch", 0))
        if micro:
            saved = tuple(int(state[k]) for k in ("global_batch_size", "micro_batch_size", "dp_size"))
            now = (self.global_batch_size, self.micro_batch_size, self.dp_size)
            if saved != now:
                raise ValueError(
                    f"the data state was saved in the middle of a step with (global_batch_size, "
                    f"micro_batch_size, dp_size)={saved}, but this run has {now}; resume from a "
                    f"checkpoint taken at a step boundary, or keep the batch sizes and DP"
                )
        self.consumed_samples = int(state["consumed_samples"])
        self.micro_batch = micro
