"""Tokenize text into a Megatron-format indexed dataset (the engine of tools/preprocess_data.py).

Two input formats (``input_format``; ``auto`` picks ``text`` for ``.txt`` / ``.txt.gz`` files and
``jsonl`` otherwise):

- ``jsonl``: each line is one JSON object; the text under ``json_key`` becomes one document;
- ``text``: plain UTF-8 text cut into documents by ``text_split``: ``auto`` (default: ``line`` for a
  file without blank lines between its lines, the one-document-per-line form of Megatron's JSONL, else
  ``paragraph``; :func:`detect_text_split`), ``paragraph`` (blocks separated by one or more blank
  lines), ``line`` (every non-empty line) or ``file`` (the whole file).

Each document becomes one sequence of token ids, optionally followed by the tokenizer's EOD id.
Documents are tokenized by ``workers`` processes (``multiprocessing``, results kept in input order,
so the output does not depend on the worker count) and written with
:class:`~folding.data.indexed.IndexedDatasetWriter`; token dtype is ``uint16`` when the vocabulary
fits, else ``int32`` (Megatron's choice). ``.gz`` input is read transparently.

Usage::

    stats = preprocess_jsonl("docs.jsonl", "out/docs", tokenizer="byte", append_eod=True, workers=2)
    stats = preprocess_jsonl("book.txt", "out/book", append_eod=True)   # paragraphs, or lines without blank ones
    stats["text_split"]                                                  # what auto chose
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

INPUT_FORMATS = ("auto", "jsonl", "text")
TEXT_SPLITS = ("auto", "paragraph", "line", "file")

_TOKENIZER = None
_KEY = "text"
_EOD = False
_JSON = True


def _init_worker(spec: str, key: str, append_eod: bool, is_json: bool = True) -> None:
    global _TOKENIZER, _KEY, _EOD, _JSON
    _TOKENIZER, _KEY, _EOD, _JSON = build_tokenizer(spec), key, append_eod, is_json


def _encode_line(args):
    lineno, line, nbytes = args
    if not line.strip():
        return lineno, None, nbytes
    if not _JSON:
        text = line
    else:
        try:
            text = json.loads(line)[_KEY]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"line {lineno}: not a JSON object with a string under key {_KEY!r} ({e}); "
                "for plain text use a .txt file or --input-format text"
            ) from None
        if not isinstance(text, str):
            raise ValueError(f"line {lineno}: the value under key {_KEY!r} is not a string")
    if hasattr(_TOKENIZER, "encode_bytes"):
        ids = np.frombuffer(_TOKENIZER.encode_bytes(text), np.uint8).astype(np.int32)
    else:
        ids = np.asarray(_TOKENIZER.encode(text), np.int32)
    if _EOD:
        ids = np.append(ids, np.int32(_TOKENIZER.eod))
    return lineno, ids, nbytes


def resolve_format(input_path: str, input_format: str) -> str:
    """``jsonl`` or ``text`` for ``input_path`` (``auto``: ``text`` for ``.txt`` / ``.txt.gz``)."""
    if input_format not in INPUT_FORMATS:
        raise ValueError(f"--input-format {input_format!r} is not one of {', '.join(INPUT_FORMATS)}")
    if input_format != "auto":
        return input_format
    return "text" if input_path.endswith((".txt", ".txt.gz")) else "jsonl"


def detect_text_split(path: str) -> str:
    """``"line"`` when plain-text file ``path`` has no blank line between two non-empty lines (one
    document per line), else ``"paragraph"``; blank lines at the start or end do not count."""
    seen_text = gap = False
    with _open_text(path) as f:
        for line in f:
            if line.strip():
                if gap and seen_text:
                    return "paragraph"
                seen_text, gap = True, False
            else:
                gap = True
    return "line"


def text_documents(lines: Iterable[str], text_split: str):
    """``(first line number, document text, bytes read)`` of plain-text ``lines`` cut by ``text_split``
    (``paragraph``, ``line`` or ``file``: ``auto`` is resolved on the file, :func:`detect_text_split`)."""
    if text_split not in TEXT_SPLITS or text_split == "auto":
        raise ValueError(f"--text-split {text_split!r} is not one of {', '.join(TEXT_SPLITS)}")
    block, start, nbytes = [], 1, 0
    for lineno, line in enumerate(lines, start=1):
        nbytes += len(line)
        if text_split == "line":
            yield lineno, line.rstrip("\n"), nbytes
            nbytes = 0
        elif text_split == "paragraph" and not line.strip():
            if block:
                yield start, "".join(block).rstrip("\n"), nbytes
                block, nbytes = [], 0
        else:
            if not block:
                start = lineno
            block.append(line)
    if block or nbytes:
        yield start, "".join(block).rstrip("\n"), nbytes


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


def preprocess_jsonl(
    input_path: str,
    output_prefix: str,
    *,
    tokenizer: str = "byte",
    json_key: str = "text",
    append_eod: bool = False,
    workers: int = 1,
    progress: bool = False,
    dtype=None,
    input_format: str = "auto",
    text_split: str = "auto",
) -> dict:
    """Tokenize ``input_path`` (JSON lines or plain text: see the module) into
    ``output_prefix.bin/.idx``; returns counts (and, for plain text, the ``text_split`` used).

    Empty lines and empty documents are skipped. Raises ``FileNotFoundError`` naming the input when
    it does not exist and ``ValueError`` for a JSON line without ``json_key`` or an input with no
    documents (nothing is left behind in that case).
    """
    is_json = resolve_format(input_path, input_format) == "jsonl"
    if text_split not in TEXT_SPLITS:
        raise ValueError(f"--text-split {text_split!r} is not one of {', '.join(TEXT_SPLITS)}")
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"--input {input_path}: no such file")
    if not is_json and text_split == "auto":
        text_split = detect_text_split(input_path)
    tok = build_tokenizer(tokenizer)
    dtype = np.dtype(dtype) if dtype is not None else optimal_dtype(tok.vocab_size)
    bar = Progress(os.path.getsize(input_path) if not input_path.endswith(".gz") else None, progress)
    docs = tokens = nbytes = 0
    writer = IndexedDatasetWriter(output_prefix, dtype=dtype)
    try:
        with _open_text(input_path) as f:
            items: Iterable = (
                ((n, line, len(line)) for n, line in enumerate(f, start=1))
                if is_json
                else text_documents(f, text_split)
            )
            if workers > 1:
                pool = mp.get_context("spawn").Pool(workers, _init_worker, (tokenizer, json_key, append_eod, is_json))
                results = pool.imap(_encode_line, items, chunksize=64)
            else:
                pool = None
                _init_worker(tokenizer, json_key, append_eod, is_json)
                results = map(_encode_line, items)
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
            what = f"no non-empty lines with key {json_key!r}" if is_json else "only blank text"
            raise ValueError(f"--input {input_path} holds no documents ({what}); nothing to write")
        writer.finalize()
    except BaseException:
        writer._bin.close()
        for ext in (".bin", ".idx"):
            if os.path.exists(output_prefix + ext):
                os.remove(output_prefix + ext)
        raise
    bar.update(docs, nbytes, final=True)
    stats = {"documents": docs, "tokens": tokens, "dtype": dtype.name, "vocab_size": tok.vocab_size}
    if not is_json:
        stats["text_split"] = text_split
    return stats
