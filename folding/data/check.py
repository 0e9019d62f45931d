"""``open_data``: open and check a job's datasets and cut them into splits, without building samples.

The one check of the data, shared by the dry run (``train.dry_run=true``, :mod:`folding.launch.dry_run`) and
the real start (:func:`folding.data.build.build_data`, which every rank calls before any collective): the
files of ``data.paths`` exist and are readable Megatron datasets of token ids in the tokenizer's
vocabulary (and in the model's, when given), and every split with a non-zero weight in ``data.split``
gets at least one document, holding at least the two tokens of one sample, in every dataset. A split of too
few documents is refused with a ``data.split`` that gives each split one (``98,1,1`` where that is enough,
else split sizes in documents). Samples are endless (each split is read epoch after epoch), so any split
that passes serves any number of steps and evaluations.

The embedded corpus (empty ``data.paths``) is tokenized into the data cache on first use, as the real
start does (about 0.1 s with the byte tokenizer).

Usage::

    opened = open_data(cfg.data, model_vocab_size=job.model.vocab_size)   # ValueError naming the setting
    opened.describe()      # one line: documents per split
    for split in opened.splits: ...   # (name, [(dataset index, prefix, IndexedDataset, weight, (begin, end))])
"""

from __future__ import annotations

import dataclasses
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .blend import SPLIT_NAMES, normalize_weights, parse_split, split_ranges
from .cache import default_cache_dir
from .config import DataConfig
from .corpus import default_corpus_prefix
from .indexed import IndexedDataset, IndexedDatasetError, preprocess_hint
from .tokenizer import build_tokenizer

SplitPart = Tuple[int, str, IndexedDataset, float, Tuple[int, int]]
"""One dataset's share of a split: (index in ``data.paths``, prefix, dataset, blend weight, document range)."""


@dataclasses.dataclass
class OpenedData:
    """The checked datasets of a job and their document ranges per split."""

    tokenizer: object
    """The tokenizer of ``data.tokenizer``."""
    prefixes: List[str]
    """The dataset prefixes (the embedded corpus' cached prefix when ``data.paths`` is empty)."""
    splits: List[Tuple[str, List[SplitPart]]]
    """``(name, parts)`` for train, valid and test; no parts for a split of weight 0."""
    cache_dir: str
    """Where the sample indices are cached."""

    def describe(self) -> str:
        """One line: the datasets and the documents each split gets."""
        counts = ", ".join(f"{name} {sum(r[1] - r[0] for *_, r in parts)}" for name, parts in self.splits if parts)
        names = ", ".join(self.prefixes)
        return f"{len(self.prefixes)} dataset(s) ({names}), documents per split: {counts}"


def open_data(config: DataConfig, *, model_vocab_size: Optional[int] = None) -> OpenedData:
    """Open and check the datasets of ``config`` and cut them into splits (see the module docstring).

    ``model_vocab_size``: the model's vocabulary, which must hold the tokenizer's. Raises ``ValueError``
    (:class:`~folding.data.indexed.IndexedDatasetError` for a file) naming the setting and a fix.
    """
    config.validate()
    tok = build_tokenizer(config.tokenizer)
    if model_vocab_size is not None and tok.vocab_size > model_vocab_size:
        raise ValueError(
            f"model.vocab_size={model_vocab_size} is smaller than the vocabulary of "
            f"data.tokenizer={config.tokenizer!r} ({tok.vocab_size}); raise model.vocab_size "
            "or use the model's tokenizer"
        )
    cache_dir = config.cache_dir or default_cache_dir()
    if config.paths:
        _check_files_exist(config)
        prefixes = list(config.paths)
        weights = normalize_weights(config.weights or [1.0] * len(prefixes), len(prefixes))
    else:
        prefixes = [default_corpus_prefix(config.tokenizer, cache_dir)]
        weights = [1.0]
    indexed = [IndexedDataset(p) for p in prefixes]
    for p, ds in zip(prefixes, indexed):
        _check_tokens(p, ds, tok, config.tokenizer)
    fractions = parse_split(config.split)
    if fractions[0] == 0:
        raise ValueError(
            f"data.split={config.split!r} gives the train split no documents; "
            f"give it a positive first number, e.g. '969,30,1'"
        )
    used = [(d, p, ds, w) for d, (p, ds, w) in enumerate(zip(prefixes, indexed, weights)) if w != 0]
    splits = []
    for k, name in enumerate(SPLIT_NAMES):
        parts = []
        for d, p, ds, w in used:
            begin, end = split_ranges(config.split, ds.num_documents)[k]
            if fractions[k] > 0 and _split_tokens(ds, begin, end) < 2:
                raise ValueError(_empty_split_message(config, name, p, ds, [x[2] for x in used]))
            if end > begin:
                parts.append((d, p, ds, w, (begin, end)))
        splits.append((name, parts))
    return OpenedData(tokenizer=tok, prefixes=prefixes, splits=splits, cache_dir=cache_dir)


def _check_files_exist(config: DataConfig) -> None:
    for p in config.paths:
        missing = [p + s for s in (".bin", ".idx") if not os.path.isfile(p + s)]
        if missing:
            raise IndexedDatasetError(
                f"data.paths entry {p!r}: {' and '.join(missing)} {'do' if len(missing) > 1 else 'does'} not "
                f"exist (data.paths takes the prefix of a tokenized dataset, PREFIX.bin + PREFIX.idx); "
                f"{preprocess_hint(p, config.tokenizer)} (to dry-run on a machine without the data, "
                "data.paths=[] checks the rest on the embedded corpus)"
            )


def _check_tokens(prefix: str, ds: IndexedDataset, tok, tokenizer: str) -> None:
    if ds.num_tokens == 0:
        raise ValueError(
            f"dataset {prefix} (data.paths) holds no tokens; remove it or re-run "
            f"tools/preprocess_data.py on non-empty input"
        )
    if ds.dtype.kind not in "iu":
        raise ValueError(
            f"dataset {prefix} stores {ds.dtype.name} values, not token ids; a training "
            f"dataset needs an integer dtype (re-run tools/preprocess_data.py)"
        )
    head = ds.get(0, 0, min(int(ds.sequence_lengths[0]), 1 << 20)) if len(ds) else np.zeros(0)
    if head.size and (int(head.min()) < 0 or int(head.max()) >= tok.vocab_size):
        raise ValueError(
            f"dataset {prefix} holds token ids outside [0, {tok.vocab_size}) of "
            f"data.tokenizer={tokenizer!r}; set data.tokenizer to the one the "
            f"dataset was written with"
        )


def _split_tokens(ds: IndexedDataset, begin: int, end: int) -> int:
    """Tokens in documents ``[begin, end)`` of ``ds``."""
    if end <= begin:
        return 0
    doc = ds.document_indices
    return int(ds.sequence_lengths[int(doc[begin]) : int(doc[end])].sum(dtype=np.int64))


def suggested_split(split, sizes: Sequence[int]) -> str:
    """A ``data.split`` that gives every split with a non-zero weight in ``split`` at least one document of
    each dataset of ``sizes`` documents: ``98,1,1`` (its zeros kept) when that does, else the smallest
    dataset's documents counted out (``N-2,1,1``: one document each for valid and test)."""
    wanted = [f > 0 for f in parse_split(split)]
    held_out = sum(wanted[1:])
    common = ",".join(str(v if w else 0) for v, w in zip((100 - held_out, 1, 1), wanted))
    if all(all(e > b for (b, e), w in zip(split_ranges(common, n), wanted) if w) for n in sizes):
        return common
    n = min(sizes)
    return ",".join(str(v if w else 0) for v, w in zip((n - held_out, 1, 1), wanted))


def _empty_split_message(config: DataConfig, name: str, prefix: str, ds: IndexedDataset, used) -> str:
    sizes = [x.num_documents for x in used]
    held_out = sum(f > 0 for f in parse_split(config.split)[1:])
    more = (
        "give the dataset more documents (plain text cut into few documents: tools/preprocess_data.py "
        "--text-split line makes one per line)"
    )
    if min(sizes) < 1 + held_out:
        fix = f"set the {name} split to 0 in data.split, or {more}"
    else:
        good = suggested_split(config.split, sizes)
        fix = f"set data.split={good} (Megatron-LM: --split {good}), or the {name} split to 0, or {more}"
    return (
        f"data.split={config.split!r} gives the {name!r} split no documents of dataset {prefix} "
        f"({ds.num_documents} documents, {ds.num_tokens} tokens): {fix}"
    )
