"""Megatron-format indexed datasets: a memory-mapped reader and a writer for ``PREFIX.bin`` + ``PREFIX.idx``.

The format is Megatron-LM's ``MMapIndexedDataset`` (version 1), so datasets tokenized for Megatron-LM
read here unchanged and datasets written here read in Megatron-LM.

``PREFIX.bin`` holds the tokens of every sequence back to back, in one dtype. ``PREFIX.idx`` holds,
all little-endian::

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    uint64    version (1)
    uint8     dtype code (see DTYPE_CODES)
    uint64    sequence count  S
    uint64    document-index count  D + 1
    int32[S]  tokens per sequence
    int64[S]  byte offset of each sequence in PREFIX.bin
    int64[D+1] document index: document d is sequences [doc[d], doc[d+1]); doc[0] = 0, doc[D] = S

A document is usually one sequence (one JSON line); tools that split sentences write several sequences
per document. Megatron's multimodal variant (a trailing per-sequence mode array) is not supported.

Usage::

    with IndexedDatasetWriter("out/corpus", dtype=np.uint16) as w:
        w.add_document([5, 6, 7, 0])
    ds = IndexedDataset("out/corpus")
    len(ds), ds[0], ds.document_indices
"""

from __future__ import annotations

import os
import struct
from typing import Iterable, List, Optional, Sequence

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    np.dtype(np.uint8): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.float64): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.uint16): 8,
}
"""Numpy dtype -> Megatron's numeric dtype code stored in the ``.idx`` header."""
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8


class IndexedDatasetError(ValueError):
    """A missing, truncated or incompatible ``.bin``/``.idx`` file; the message names the file."""


def optimal_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron picks for a vocabulary: ``uint16`` below 65500 ids, else ``int32``."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def _read_header(idx_path: str):
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(_HEADER_BYTES)
    if len(head) < len(MAGIC) or head[: len(MAGIC)] != MAGIC:
        raise IndexedDatasetError(
            f"{idx_path} is not a Megatron indexed-dataset index (bad magic {head[:9]!r}); "
            f"rebuild it with tools/preprocess_data.py"
        )
    if len(head) < _HEADER_BYTES:
        raise IndexedDatasetError(
            f"{idx_path} is truncated ({size} bytes, header needs {_HEADER_BYTES}); "
            f"rebuild it with tools/preprocess_data.py"
        )
    (version,) = struct.unpack("<Q", head[9:17])
    if version != VERSION:
        raise IndexedDatasetError(
            f"{idx_path} has index version {version}; only version {VERSION} (Megatron's MMIDIDX format) is supported"
        )
    code = head[17]
    if code not in CODE_DTYPES:
        raise IndexedDatasetError(
            f"{idx_path} has unknown dtype code {code}; known codes: { {c: d.name for c, d in CODE_DTYPES.items()} }"
        )
    seq_count, doc_count = struct.unpack("<QQ", head[18:34])
    expected = _HEADER_BYTES + seq_count * (4 + 8) + doc_count * 8
    if size != expected:
        kind = "truncated" if size < expected else "longer than its header says"
        raise IndexedDatasetError(
            f"{idx_path} is {kind}: {size} bytes, expected {expected} for {seq_count} sequences and "
            f"{doc_count} document-index entries (multimodal indices are not supported); rebuild it"
        )
    return CODE_DTYPES[code], seq_count, doc_count


RAW_SUFFIXES = (".txt.gz", ".jsonl.gz", ".json.gz", ".txt", ".jsonl", ".json")
"""Endings of the raw inputs ``tools/preprocess_data.py`` reads (plain text, JSON lines; gzipped or not)."""


def preprocess_hint(prefix: str, tokenizer: str = "byte") -> str:
    """The command that writes ``PREFIX.bin`` + ``PREFIX.idx`` for a dataset prefix that has neither.

    When ``prefix`` is itself a raw input (a file that exists, or a name ending in one of
    :data:`RAW_SUFFIXES`), that file is the ``--input`` and the prefix is its name without the ending
    (``notes.txt`` -> ``--input notes.txt --output-prefix notes``, then ``data.paths=[notes]``); otherwise
    the command writes ``prefix`` from a text or JSON-lines file the user names. ``tokenizer`` other than
    ``byte`` is passed on (the dataset must be written with the tokenizer it is read with).
    """
    ending = next((s for s in RAW_SUFFIXES if prefix.endswith(s)), None)
    raw = ending is not None or os.path.isfile(prefix)
    if raw:
        out = prefix[: -len(ending)] if ending else prefix + "_tokens"
        source = prefix
    else:
        out, source = prefix, "<your .txt or .jsonl file>"
    tok = "" if tokenizer == "byte" else f" --tokenizer {tokenizer}"
    command = f"python -m tools.preprocess_data --input {source} --output-prefix {out}{tok} --append-eod"
    if raw:
        return f"{prefix} is raw text, not a tokenized dataset: run {command}, then set data.paths=[{out}]"
    return f"write it with {command}"


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.bin`` + ``PREFIX.idx``.

    ``len(ds)`` is the number of sequences; ``ds[i]`` the i-th sequence as a 1-D numpy array (a
    read-only view of the mapped file); ``ds.get(i, offset, length)`` a slice of it.
    ``ds.document_indices`` gives document boundaries (document d = sequences
    ``[doc[d], doc[d+1])``). Opening validates both files completely against the header.
    """

    def __init__(self, prefix: str):
        self.prefix = str(prefix)
        self.idx_path = self.prefix + ".idx"
        self.bin_path = self.prefix + ".bin"
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(
                    f"{path} does not exist; a dataset prefix needs both PREFIX.bin and PREFIX.idx "
                    f"({preprocess_hint(self.prefix)})"
                )
        self.dtype, seq_count, doc_count = _read_header(self.idx_path)
        idx = np.memmap(self.idx_path, mode="r", dtype=np.uint8)
        off = _HEADER_BYTES
        self.sequence_lengths = np.frombuffer(idx, np.int32, seq_count, off)
        """Tokens per sequence (int32, length ``len(ds)``)."""
        off += 4 * seq_count
        self.sequence_pointers = np.frombuffer(idx, np.int64, seq_count, off)
        """Byte offset of each sequence in ``PREFIX.bin`` (int64)."""
        off += 8 * seq_count
        self.document_indices = np.frombuffer(idx, np.int64, doc_count, off)
        """Document boundaries in sequence units (int64, length documents + 1)."""
        self._idx_map = idx
        if (
            doc_count < 1
            or self.document_indices[0] != 0
            or self.document_indices[-1] != seq_count
            or np.any(np.diff(self.document_indices) < 0)
        ):
            raise IndexedDatasetError(f"{self.idx_path} has an invalid document index; rebuild it")
        total = int(self.sequence_lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        bin_size = os.path.getsize(self.bin_path)
        if bin_size != total:
            kind = "truncated" if bin_size < total else "longer than its index says"
            raise IndexedDatasetError(
                f"{self.bin_path} is {kind}: {bin_size} bytes, but {self.idx_path} describes "
                f"{total} bytes of {self.dtype.name} tokens; the two files do not belong together or "
                f"the copy is incomplete"
            )
        self._check_pointers()
        self._bin = np.memmap(self.bin_path, mode="r", dtype=np.uint8) if total else np.zeros(0, np.uint8)

    def _check_pointers(self, chunk: int = 1 << 22) -> None:
        """Lengths are non-negative and pointers are their running byte offsets (checked in chunks)."""
        carry = 0
        size = self.dtype.itemsize
        for lo in range(0, len(self.sequence_lengths), chunk):
            lengths = self.sequence_lengths[lo : lo + chunk].astype(np.int64)
            if lengths.size and lengths.min() < 0:
                raise IndexedDatasetError(f"{self.idx_path} has negative sequence lengths; rebuild it")
            expected = carry + np.concatenate(([0], np.cumsum(lengths[:-1] * size)))
            if not np.array_equal(expected, self.sequence_pointers[lo : lo + chunk]):
                raise IndexedDatasetError(
                    f"{self.idx_path} has sequence pointers that do not match its lengths; rebuild it"
                )
            carry = int(expected[-1] + lengths[-1] * size)

    def __len__(self) -> int:
        return int(self.sequence_lengths.shape[0])

    @property
    def num_documents(self) -> int:
        """Number of documents (``len(document_indices) - 1``)."""
        return int(self.document_indices.shape[0]) - 1

    @property
    def num_tokens(self) -> int:
        """Total number of tokens in ``PREFIX.bin``."""
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` (to its end when ``length`` is None)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {self.prefix} with {n} sequences")
        i %= n
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {i} of length {size} in {self.prefix}"
            )
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(int(i))

    def document(self, d: int) -> List[np.ndarray]:
        """The sequences of document ``d``."""
        a, b = int(self.document_indices[d]), int(self.document_indices[d + 1])
        return [self.get(i) for i in range(a, b)]


class IndexedDatasetWriter:
    """Writes exactly ``PREFIX.bin`` and ``PREFIX.idx`` in Megatron's format.

    Call :meth:`add_document` per document (one or more sequences), or :meth:`add_sequence` then
    :meth:`end_document`; :meth:`finalize` (or leaving the ``with`` block) writes the index. Tokens
    must fit ``dtype`` (checked).
    """

    def __init__(self, prefix: str, dtype=np.uint16):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODES:
            raise ValueError(
                f"dtype {self.dtype} is not one Megatron writes; choose one of {sorted(d.name for d in DTYPE_CODES)}"
            )
        parent = os.path.dirname(os.path.abspath(self.prefix))
        os.makedirs(parent, exist_ok=True)
        self._bin = open(self.prefix + ".bin", "wb")
        self._lengths: List[int] = []
        self._docs: List[int] = [0]
        self._finalized = False
        if self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            self._range = (int(info.min), int(info.max))
        else:
            self._range = None

    def add_sequence(self, tokens: Iterable) -> None:
        """Append one sequence of tokens (any integer sequence or array)."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a sequence must be 1-D, got shape {arr.shape}")
        if self._range is not None and arr.size and arr.dtype != self.dtype:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._range[0] or hi > self._range[1]:
                raise ValueError(
                    f"token ids in [{lo}, {hi}] do not fit {self.dtype.name}; write with a wider dtype (e.g. int32)"
                )
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(int(arr.size))

    def end_document(self) -> None:
        """Close the current document (the sequences added since the previous boundary)."""
        self._docs.append(len(self._lengths))

    def add_document(self, *sequences: Sequence) -> None:
        """Append one document made of the given sequences (usually just one)."""
        for seq in sequences:
            self.add_sequence(seq)
        self.end_document()

    def finalize(self) -> None:
        """Close ``PREFIX.bin`` and write ``PREFIX.idx``."""
        if self._finalized:
            return
        self._bin.close()
        if self._docs[-1] != len(self._lengths):
            self.end_document()
        lengths = np.asarray(self._lengths, np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        if len(lengths):
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(self.prefix + ".idx", "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", DTYPE_CODES[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(self._docs)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self._docs, np.int64).tobytes(order="C"))
        self._finalized = True

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self._bin.close()
