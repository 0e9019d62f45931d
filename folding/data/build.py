"""``build_data``: from a :class:`DataConfig` to this rank's train / valid / test micro-batch iterators.

Everything that can be wrong with the data (a missing or corrupt file, weights that do not match the
paths, a tokenizer path that does not exist, an empty split) fails here, before training starts and
before any collective. The result depends only on the config, the sequence length and the batch sizes;
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
import os
from typing import Dict, List, Optional

import numpy as np

from .blend import SPLIT_NAMES, BlendedDataset, normalize_weights, parse_split, split_ranges
from .cache import default_cache_dir
from .config import DataConfig
from .corpus import default_corpus_prefix
from .gpt_dataset import GPTDataset
from .indexed import IndexedDataset, IndexedDatasetError, preprocess_hint
from .sampler import MicroBatchIterator, check_batch_sizes
from .tokenizer import build_tokenizer


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
) -> Data:
    """Open, split and blend the datasets of ``config`` and return this DP rank's iterators.

    ``seed`` overrides ``config.seed`` when given. ``eval_global_batch_size`` (default: the training
    one) sets the global batch of the valid and test iterators.
    """
    config.validate()
    if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 1:
        raise ValueError(f"seq_length={seq_length!r} must be an integer >= 1")
    check_batch_sizes(global_batch_size, micro_batch_size, dp_size, dp_rank)
    eval_gbs = eval_global_batch_size or global_batch_size
    check_batch_sizes(eval_gbs, micro_batch_size, dp_size, dp_rank)
    seed = config.seed if seed is None else int(seed)
    tok = build_tokenizer(config.tokenizer)
    cache_dir = config.cache_dir or default_cache_dir()
    if config.paths:
        prefixes = list(config.paths)
        weights = normalize_weights(config.weights or [1.0] * len(prefixes), len(prefixes))
    else:
        prefixes = [default_corpus_prefix(config.tokenizer, cache_dir)]
        weights = [1.0]
    for p in config.paths or []:
        missing = [p + s for s in (".bin", ".idx") if not os.path.isfile(p + s)]
        if missing:
            raise IndexedDatasetError(
                f"data.paths entry {p!r}: {' and '.join(missing)} {'do' if len(missing) > 1 else 'does'} not "
                f"exist (data.paths takes the prefix of a tokenized dataset, PREFIX.bin + PREFIX.idx); "
                f"{preprocess_hint(p, config.tokenizer)}"
            )
    indexed = [IndexedDataset(p) for p in prefixes]
    for p, ds in zip(prefixes, indexed):
        if ds.num_tokens == 0:
            raise ValueError(
                f"dataset {p} (data.paths) holds no tokens; remove it or re-run "
                f"tools/preprocess_data.py on non-empty input"
            )
        if ds.dtype.kind not in "iu":
            raise ValueError(
                f"dataset {p} stores {ds.dtype.name} values, not token ids; a training "
                f"dataset needs an integer dtype (re-run tools/preprocess_data.py)"
            )
        head = ds.get(0, 0, min(int(ds.sequence_lengths[0]), 1 << 20)) if len(ds) else np.zeros(0)
        if head.size and (int(head.min()) < 0 or int(head.max()) >= tok.vocab_size):
            raise ValueError(
                f"dataset {p} holds token ids outside [0, {tok.vocab_size}) of "
                f"data.tokenizer={config.tokenizer!r}; set data.tokenizer to the one the "
                f"dataset was written with"
            )
    fractions = parse_split(config.split)
    if fractions[0] == 0:
        raise ValueError(
            f"data.split={config.split!r} gives the train split no documents; "
            f"give it a positive first number, e.g. '969,30,1'"
        )
    splits = {}
    for k, name in enumerate(SPLIT_NAMES):
        parts = []
        for d, (p, ds, w) in enumerate(zip(prefixes, indexed, weights)):
            if w == 0:
                continue
            begin, end = split_ranges(config.split, ds.num_documents)[k]
            if end == begin:
                if fractions[k] > 0:
                    raise ValueError(
                        f"dataset {p} has no documents in the {name!r} split of data.split="
                        f"{config.split!r} ({ds.num_documents} documents); give that split more weight, "
                        f"set it to 0, or use a larger dataset (plain text cut into few documents: "
                        f"tools/preprocess_data.py --text-split line makes one per line)"
                    )
                continue
            parts.append(
                (
                    GPTDataset(
                        ds,
                        documents=(begin, end),
                        seq_length=seq_length,
                        seed=seed,
                        stream=f"{name}/{d}",
                        pad=tok.eod,
                        cache_dir=cache_dir,
                        shuffle=config.shuffle,
                    ),
                    w,
                )
            )
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
    return Data(train=splits["train"], valid=splits["valid"], test=splits["test"], tokenizer=tok, prefixes=prefixes)
