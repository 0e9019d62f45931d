"""Tokenize JSON-lines text into a Megatron-format indexed dataset (the engine of tools/preprocess_data.py).

Each input line is one JSON object; the text under ``json_key`` becomes one document (one sequence),
optionally followed by the tokenizer's EOD id. Lines are tokenized by ``workers`` processes
(``multiprocessing``, results kept in input order, so the output does not depend on the worker count)
and written with :class:`~folding.data.indexed.IndexedDatasetWriter`; token dtype is ``uint16`` when
the vocabulary fits, else ``int32`` (Megatron's choice). ``.jsonl.gz`` input is read transparently.

Usage::

    stats = preprocess_jsonl("docs.jsonl", "out/docs", tokenizer="byte", append_eod=True, workers=2)
"""
from __future__ import annotations

import gzip
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Iterable, Optional

import numpy as np

from .indexed import IndexedDatasetWriter, optimal_dtype
from .tokenizer import build_tokenizer

_TOKENIZER = None
_KEY = "text"
_EOD = False


def _init_worker(spec: str, key: str, append_eod: bool) -> None:
    global _TOKENIZER, _KEY, _EOD
    _TOKENIZER, _KEY, _EOD = build_tokenizer(spec), key, append_eod


def _encode_line(args):
    lineno, line = args
    if not line.strip():
        return lineno, None, 0
    try:
        text = json.loads(line)[_KEY]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"line {lineno}: not a JSON object with a string under key {_KEY!r} ({e})") from None
    if not isinstance(text, str):
        raise ValueError(f"line {lineno}: the value under key {_KEY!r} is not a string")
    if hasattr(_TOKENIZER, "encode_bytes"):
        ids = np.frombuffer(_TOKENIZER.encode_bytes(text), np.uint8).astype(np.int32)
    else:
        ids = np.asarray(_TOKENIZER.encode(text), np.int32)
    if _EOD:
        ids = np.append(ids, np.int32(_TOKENIZER.eod))
    return lineno, ids, len(line)


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


class Progress:
    """A one-line progress report on stderr (documents, MB read, rate), throttled to ~4 updates/s."""

    def __init__(self, total_bytes: Optional[int], enabled: bool = True):
        self.total = total_bytes
        self.enabled = enabled
        self.start = self.last = time.time()

    def update(self, docs: int, nbytes: int, final: bool = False) -> None:
        """Redraw with ``docs`` documents and ``nbytes`` input bytes done."""
        now = time.time()
        if not self.enabled or (not final and now - self.last < 0.25):
            return
        self.last = now
        rate = nbytes / max(now - self.start, 1e-9) / 1e6
        pct = f" {100.0 * nbytes / self.total:5.1f}%" if self.total else ""
        sys.stderr.write(f"\r{docs} documents, {nbytes / 1e6:.1f} MB{pct} ({rate:.1f} MB/s)")
        if final:
            sys.stderr.write("\n")
        sys.stderr.flush()


def preprocess_jsonl(input_path: str, output_prefix: str, *, tokenizer: str = "byte", json_key: str = "text",
                     append_eod: bool = False, workers: int = 1, progress: bool = False,
                     dtype=None) -> dict:
    """Tokenize ``input_path`` (JSON lines) into ``output_prefix.bin/.idx``; returns counts.

    Empty lines are skipped. Raises ``FileNotFoundError`` naming the input when it does not exist and
    ``ValueError`` for a line without ``json_key`` or an input with no documents (nothing is left
    behind in that case).
    """
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"--input {input_path}: no such file")
    tok = build_tokenizer(tokenizer)
    dtype = np.dtype(dtype) if dtype is not None else optimal_dtype(tok.vocab_size)
    bar = Progress(os.path.getsize(input_path) if not input_path.endswith(".gz") else None, progress)
    docs = tokens = nbytes = 0
    writer = IndexedDatasetWriter(output_prefix, dtype=dtype)
    try:
        with _open_text(input_path) as f:
            lines: Iterable = enumerate(f, start=1)
            if workers > 1:
                pool = mp.get_context("spawn").Pool(workers, _init_worker, (tokenizer, json_key, append_eod))
                results = pool.imap(_encode_line, lines, chunksize=64)
            else:
                pool = None
                _init_worker(tokenizer, json_key, append_eod)
                results = map(_encode_line, lines)
            try:
                for _, ids, n in results:
                    nbytes += n
                    if ids is None:
                        continue
                    writer.add_document(ids)
                    docs += 1
                    tokens += len(ids)
                    bar.update(docs, nbytes)
            finally:
                if pool is not None:
                    pool.terminate()
        if docs == 0:
            raise ValueError(f"--input {input_path} holds no documents (no non-empty lines with key "
                             f"{json_key!r}); nothing to write")
        writer.finalize()
    except BaseException:
        writer._bin.close()
        for ext in (".bin", ".idx"):
            if os.path.exists(output_prefix + ext):
                os.remove(output_prefix + ext)
        raise
    bar.update(docs, nbytes, final=True)
    return {"documents": docs, "tokens": tokens, "dtype": dtype.name, "vocab_size": tok.vocab_size}
