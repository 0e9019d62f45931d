"""``build_data``: from a :class:`DataConfig` to this rank's train / valid / test micro-batch iterators.

Everything that can be wrong with the data (a missing or corrupt file, weights that do not match the
paths, a tokenizer path that does not exist, an empty split) fails here, before training starts and
before any collective, with the check the dry run makes (:func:`folding.data.check.open_data`). The result
depends only on the config, the sequence length and the batch sizes;
``dp_rank`` / ``dp_size`` only select this rank's share of each global batch (see
:mod:`folding.data.sampler`).

Usage::

    data = build_data(cfg.data, seq_length=4096, global_batch_size=256, micro_batch_size=1,
                      dp_rank=ps.coords.dp.rank, dp_size=layout.dp)
    mb = next(data.train)                         # tokens, labels, loss_mask, ...
    state = data.state_dict()                     # save with the checkpoint
    data.load_state_dict(state)                   # exact resume
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from .blend import BlendedDataset
from .check import open_data
from .config import DataConfig
from .gpt_dataset import GPTDataset
from .sampler import MicroBatchIterator, check_batch_sizes


@dataclasses.dataclass
class Data:
    """This rank's data: one endless iterator per split (``None`` for a split of weight 0)."""

    train: MicroBatchIterator
    """Training micro-batches."""
    valid: Optional[MicroBatchIterator]
    """Validation micro-batches (their own position, advanced only by evaluation)."""
    test: Optional[MicroBatchIterator]
    """Test micro-batches."""
    tokenizer: object
    """The tokenizer (``vocab_size``, ``eod``, ``encode``, ``decode``)."""
    prefixes: List[str]
    """The dataset prefixes in use (the embedded corpus' cached prefix when ``data.paths`` is empty)."""

    @property
    def vocab_size(self) -> int:
        """Token ids are in ``[0, vocab_size)``."""
        return self.tokenizer.vocab_size

    def describe(self) -> str:
        """A few lines for the job log: datasets, and per split the samples per epoch and the blend."""
        lines = [
            f"data: {len(self.prefixes)} dataset(s), tokenizer {self.tokenizer.name} "
            f"(vocab_size {self.vocab_size}, eod {self.tokenizer.eod})"
        ]
        for name, it in self._iterators().items():
            ds = it.dataset
            parts = list(zip(ds.datasets, ds.weights)) if isinstance(ds, BlendedDataset) else [(ds, 1.0)]
            body = ", ".join(
                f"{p.indexed.prefix} docs [{p.begin}, {p.end}) {p.num_tokens} tokens "
                f"{p.samples_per_epoch} samples/epoch weight {w:.3f}"
                for p, w in parts
            )
            lines.append(f"  {name}: {body}")
        return "\n".join(lines)

    def state_dict(self) -> Dict[str, dict]:
        """Positions of every iterator (plain ints; checkpoint them)."""
        return {name: it.state_dict() for name, it in self._iterators().items()}

    def load_state_dict(self, state: Dict[str, dict]) -> None:
        """Restore positions saved by :meth:`state_dict`."""
        for name, it in self._iterators().items():
            if name in state:
                it.load_state_dict(state[name])

    def _iterators(self) -> Dict[str, MicroBatchIterator]:
        return {n: it for n, it in (("train", self.train), ("valid", self.valid), ("test", self.test)) if it}


def build_data(
    config: DataConfig,
    *,
    seq_length: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: Optional[int] = None,
    eval_global_batch_size: Optional[int] = None,
    model_vocab_size: Optional[int] = None,
) -> Data:
    """Open, split and blend the datasets of ``config`` and return this DP rank's iterators.

    ``seed`` overrides ``config.seed`` when given. ``eval_global_batch_size`` (default: the training
    one) sets the global batch of the valid and test iterators. The datasets are checked first by
    :func:`folding.data.check.open_data` (with ``model_vocab_size``: the model's vocabulary must hold the
    tokenizer's), the check the dry run makes.
    """
    config.validate()
    if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 1:
        raise ValueError(f"seq_length={seq_length!r} must be an integer >= 1")
    check_batch_sizes(global_batch_size, micro_batch_size, dp_size, dp_rank)
    eval_gbs = eval_global_batch_size or global_batch_size
    check_batch_sizes(eval_gbs, micro_batch_size, dp_size, dp_rank)
    seed = config.seed if seed is None else int(seed)
    opened = open_data(config, model_vocab_size=model_vocab_size)
    tok = opened.tokenizer
    splits = {}
    for name, found in opened.splits:
        parts = [
            (
                GPTDataset(
                    ds,
                    documents=docs,
                    seq_length=seq_length,
                    seed=seed,
                    stream=f"{name}/{d}",
                    pad=tok.eod,
                    cache_dir=opened.cache_dir,
                    shuffle=config.shuffle,
                ),
                w,
            )
            for d, _, ds, w, docs in found
        ]
        if not parts:
            splits[name] = None
            continue
        dataset = (
            parts[0][0]
            if len(parts) == 1
            else BlendedDataset([p for p, _ in parts], [w for _, w in parts], block_size=config.blend_block_size)
        )
        splits[name] = MicroBatchIterator(
            dataset,
            global_batch_size=global_batch_size if name == "train" else eval_gbs,
            micro_batch_size=micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seq_length=seq_length,
            eod=tok.eod,
            eod_mask_loss=config.eod_mask_loss,
        )
    return Data(
        train=splits["train"], valid=splits["valid"], test=splits["test"], tokenizer=tok, prefixes=opened.prefixes
    )
