"""GPT-style samples: documents concatenated in a shuffled order and cut into ``seq_length + 1`` tokens.

A :class:`GPTDataset` covers a range of documents of one :class:`IndexedDataset` (its split) and is an
endless stream of epochs. Epoch ``e``:

1. orders the split's documents by a permutation drawn from ``(seed, stream, e)`` (the sequences of a
   document stay together and in order);
2. concatenates their tokens into one stream of ``T`` tokens and cuts it into
   ``N = ceil((T - 1) / seq_length)`` samples: sample ``j`` is stream tokens
   ``[j*seq_length, j*seq_length + seq_length + 1)`` (consecutive samples share one token: the last
   label of one is the first input of the next). The last sample of an epoch may be short and is
   padded; its padding is masked out of the loss;
3. visits those ``N`` samples in a shuffled order drawn from ``(seed, stream, e)``.

Global sample index ``i`` is sample ``shuffle_e[i % N]`` of epoch ``e = i // N``, so indices
``[e*N, (e+1)*N)`` hold every sample of epoch ``e`` exactly once. The per-epoch index (document order,
sample boundaries, shuffle) is cached as ``.npy`` files under ``cache_dir`` when one is given, built
once across concurrent processes (see :mod:`folding.data.cache`).

Usage::

    ds = GPTDataset(IndexedDataset(prefix), documents=(0, 900), seq_length=128, seed=1234,
                    stream="train/0", pad=tok.eod, cache_dir="/tmp/cache")
    tokens, n_real = ds[0]        # int64 array of seq_length + 1 tokens, count of real ones
"""

from __future__ import annotations

import hashlib
import os
import zlib
from typing import Optional, Tuple

import numpy as np

from .cache import build_once
from .indexed import IndexedDataset

_INDEX_VERSION = "gpt-index-v1"


def epoch_rng(seed: int, stream: str, epoch: int, purpose: str) -> np.random.Generator:
    """A numpy generator determined by ``(seed, stream, epoch, purpose)`` only (identical everywhere)."""
    words = [int(seed) % (1 << 64), zlib.crc32(stream.encode()), int(epoch), zlib.crc32(purpose.encode())]
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(words)))


class GPTDataset:
    """Endless epochs of ``seq_length + 1``-token samples from documents ``[begin, end)`` of ``indexed``.

    ``samples_per_epoch`` is ``N``; ``ds[i]`` returns ``(tokens, n_real)`` for global index ``i >= 0``.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        *,
        documents: Tuple[int, int],
        seq_length: int,
        seed: int,
        stream: str,
        pad: int,
        cache_dir: Optional[str] = None,
        shuffle: bool = True,
    ):
        self.indexed = indexed
        self.begin, self.end = int(documents[0]), int(documents[1])
        if not 0 <= self.begin < self.end <= indexed.num_documents:
            raise ValueError(
                f"document range [{self.begin}, {self.end}) is empty or outside the "
                f"{indexed.num_documents} documents of {indexed.prefix}"
            )
        if seq_length < 1:
            raise ValueError(f"seq_length={seq_length} must be >= 1")
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.stream = stream
        self.pad = int(pad)
        self.shuffle = shuffle
        self.cache_dir = cache_dir
        doc_idx = indexed.document_indices
        seq_lo, seq_hi = int(doc_idx[self.begin]), int(doc_idx[self.end])
        self.num_tokens = int(indexed.sequence_lengths[seq_lo:seq_hi].sum(dtype=np.int64))
        """Tokens per epoch ``T`` (all tokens of the split's documents)."""
        if self.num_tokens < 2:
            raise ValueError(
                f"documents [{self.begin}, {self.end}) of {indexed.prefix} hold "
                f"{self.num_tokens} tokens; a sample needs at least 2"
            )
        self.samples_per_epoch = -(-(self.num_tokens - 1) // self.seq_length)
        """Samples per epoch ``N = ceil((T - 1) / seq_length)``."""
        self._epochs = {}
        st = os.stat(indexed.idx_path)
        key = "|".join(
            map(
                str,
                (
                    _INDEX_VERSION,
                    os.path.realpath(indexed.idx_path),
                    st.st_size,
                    st.st_mtime_ns,
                    self.begin,
                    self.end,
                    self.seq_length,
                    self.seed,
                    self.stream,
                    self.shuffle,
                ),
            )
        )
        self._key = hashlib.sha256(key.encode()).hexdigest()[:20]

    def _build_epoch(self, epoch: int):
        """(sequence order, sample index [N+1, 2] of (position in order, token offset), shuffle [N])."""
        doc_idx = self.indexed.document_indices
        docs = np.arange(self.begin, self.end, dtype=np.int64)
        if self.shuffle:
            docs = epoch_rng(self.seed, self.stream, epoch, "documents").permutation(docs)
        starts, stops = doc_idx[docs], doc_idx[docs + 1]
        counts = stops - starts
        # sequence ids of the documents in order: starts[d] + 0..counts[d]-1, concatenated
        offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
        order = offsets + np.arange(int(counts.sum()), dtype=np.int64)
        cum = np.zeros(len(order) + 1, np.int64)
        np.cumsum(self.indexed.sequence_lengths[order], out=cum[1:])
        n = self.samples_per_epoch
        token_starts = np.minimum(np.arange(n + 1, dtype=np.int64) * self.seq_length, cum[-1])
        pos = np.searchsorted(cum, token_starts, side="right") - 1
        sample_index = np.stack([pos, token_starts - cum[pos]], axis=1).astype(np.int64)
        shuffle = np.arange(n, dtype=np.int64)
        if self.shuffle:
            shuffle = epoch_rng(self.seed, self.stream, epoch, "samples").permutation(shuffle)
        return order, sample_index, shuffle

    def _epoch(self, epoch: int):
        if epoch in self._epochs:
            return self._epochs[epoch]
        if self.cache_dir:

            def build(tmp):
                for name, arr in zip(("order", "sample_index", "shuffle"), self._build_epoch(epoch)):
                    np.save(os.path.join(tmp, name + ".npy"), arr)

            path = build_once(os.path.join(self.cache_dir, f"gpt-{self._key}-e{epoch}"), build)
            arrays = tuple(
                np.load(os.path.join(path, n + ".npy"), mmap_mode="r") for n in ("order", "sample_index", "shuffle")
            )
        else:
            arrays = self._build_epoch(epoch)
        if len(self._epochs) >= 2:  # sequential readers need the current and the next epoch
            self._epochs.pop(min(self._epochs))
        self._epochs[epoch] = arrays
        return arrays

    def locate(self, i: int) -> Tuple[int, int]:
        """``(epoch, sample within the epoch before shuffling)`` of global index ``i``."""
        if i < 0:
            raise IndexError(f"sample index {i} must be >= 0")
        epoch, j = divmod(int(i), self.samples_per_epoch)
        return epoch, int(self._epoch(epoch)[2][j])

    def __getitem__(self, i: int) -> Tuple[np.ndarray, int]:
        epoch, j = self.locate(i)
        order, sample_index, _ = self._epoch(epoch)
        want = self.seq_length + 1
        start = j * self.seq_length
        need = min(start + want, self.num_tokens) - start
        p, off = int(sample_index[j][0]), int(sample_index[j][1])
        lengths = self.indexed.sequence_lengths
        parts = []
        while need > 0:
            seq = int(order[p])
            take = min(int(lengths[seq]) - off, need)
            if take > 0:
                parts.append(self.indexed.get(seq, off, take))
            need -= take
            p, off = p + 1, 0
        tokens = np.empty(want, np.int64)
        n_real = 0
        for part in parts:
            tokens[n_real : n_real + len(part)] = part
            n_real += len(part)
        tokens[n_real:] = self.pad
        return tokens, n_real
