"""The routing trace file (``moe.trace_dir``): its format, rank 0's writer and the reader.

One file per run, ``<moe.trace_dir>/routing_trace.bin``:

- a header of :data:`HEADER_BYTES` bytes: the magic ``FOLDTRC1``, then a UTF-8 JSON object padded
  with spaces (``format_version``, ``model``, ``num_layers`` L, ``layer_numbers``, ``num_experts`` E,
  ``topk``, ``source_ranks`` R, ``layout`` (the sizes and order of the layout that recorded it),
  ``ep``, ``dtype`` of the counts, ``record`` (the fields of one record, in order), ``record_bytes``,
  ``first_step``, ``last_step``; the step range is ``null`` before the first record);
- then one fixed-size record per step, little-endian: the step (int64), ``counts_LRE`` (int32: rows
  that source rank r routed to expert e in MoE layer l, after capacity) and ``dropped_LRE`` (int32:
  the (token, expert) pairs capacity dropped).

Source ranks are the world's ranks: every rank routes distinct tokens, so the sum over R equals the
``expert_counts`` of ``metrics.jsonl``. With pipeline parallelism a layer's rows are non-zero only on
the ranks of the stage that holds it.

Records are appended and the header's step range rewritten in place after each one, so a run that
stops at any point leaves a readable file. A run that starts at step 1 replaces the file; a resumed
run (starting at step s+1) drops the records of steps > s, which it recomputes, and appends; it must
have the same geometry (L, E, R, layer numbers), or :func:`check_resume` fails naming
``moe.trace_dir``.

Usage::

    w = TraceWriter(path, header, start_step=1)       # rank 0
    w.append(step, counts_LRE, dropped_LRE); w.close()
    t = read_trace(path)                              # t.steps [S], t.counts_SLRE, t.dropped_SLRE
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Optional

import numpy as np

FILE_NAME = "routing_trace.bin"
MAGIC = b"FOLDTRC1"
HEADER_BYTES = 8192
FORMAT_VERSION = 1
RECORD_FIELDS = ["step:int64", "counts:int32[L,R,E]", "dropped:int32[L,R,E]"]
GEOMETRY = ("num_layers", "layer_numbers", "num_experts", "source_ranks")


def trace_path(trace_dir: str) -> str:
    """The trace file of ``moe.trace_dir``."""
    return os.path.join(trace_dir, FILE_NAME)


def make_header(
    *, model: str, layer_numbers, num_experts: int, topk: int, source_ranks: int, layout: Dict[str, Any]
) -> Dict[str, Any]:
    """The header of a new trace (step range empty); ``layout`` holds the sizes and ``order``."""
    L, E, R = len(layer_numbers), num_experts, source_ranks
    return {
        "format_version": FORMAT_VERSION,
        "model": model,
        "num_layers": L,
        "layer_numbers": list(layer_numbers),
        "num_experts": E,
        "topk": topk,
        "source_ranks": R,
        "layout": dict(layout),
        "ep": int(layout.get("ep", 1)),
        "dtype": "int32",
        "record": RECORD_FIELDS,
        "record_bytes": 8 + 2 * 4 * L * R * E,
        "first_step": None,
        "last_step": None,
    }


def _encode(header: Dict[str, Any]) -> bytes:
    body = json.dumps(header).encode()
    if len(MAGIC) + len(body) > HEADER_BYTES:
        raise ValueError(f"trace header of {len(body)} bytes does not fit in {HEADER_BYTES}")
    return MAGIC + body + b" " * (HEADER_BYTES - len(MAGIC) - len(body))


def read_header(path: str) -> Dict[str, Any]:
    """The header of the trace file ``path`` (``ValueError`` if it is not one)."""
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    if len(raw) != HEADER_BYTES or not raw.startswith(MAGIC):
        raise ValueError(f"{path} is not a routing trace (no {MAGIC.decode()} header)")
    header = json.loads(raw[len(MAGIC) :].decode())
    if header.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: trace format_version {header.get('format_version')}, this reader reads {FORMAT_VERSION}"
        )
    return header


def check_resume(path: str, header: Dict[str, Any]) -> Optional[str]:
    """Why a resumed run with ``header`` cannot append to the trace at ``path`` (``None`` when it can,
    or when there is no file yet)."""
    if not os.path.exists(path):
        return None
    try:
        old = read_header(path)
    except ValueError as e:
        return str(e)
    diff = [f"{k} {old.get(k)!r} -> {header[k]!r}" for k in GEOMETRY if old.get(k) != header[k]]
    if diff:
        return f"the trace {path} was recorded with other geometry ({'; '.join(diff)})"
    return None


class TraceWriter:
    """Rank 0's appender (see the module docstring)."""

    def __init__(self, path: str, header: Dict[str, Any], *, start_step: int):
        """Open ``path`` for a run whose first step is ``start_step``: a new file at step 1 (or when
        none exists), else keep the records before ``start_step`` and append after them."""
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.header = dict(header)
        self.record_bytes = header["record_bytes"]
        if start_step > 1 and os.path.exists(path):
            reason = check_resume(path, header)
            if reason:
                raise ValueError(f"moe.trace_dir: {reason}; set moe.trace_dir to another directory")
            kept = read_trace(path).steps
            keep = int((kept < start_step).sum())
            self.f = open(path, "r+b")
            self.f.truncate(HEADER_BYTES + keep * self.record_bytes)
            self.header["first_step"] = int(kept[0]) if keep else None
            self.header["last_step"] = int(kept[keep - 1]) if keep else None
        else:
            self.f = open(path, "w+b")
        self.f.seek(0)
        self.f.write(_encode(self.header))
        self.f.seek(0, os.SEEK_END)
        self.f.flush()

    def append(self, step: int, counts_LRE: np.ndarray, dropped_LRE: np.ndarray) -> None:
        """Append the record of ``step`` and move the header's step range to include it."""
        rec = np.asarray(step, dtype="<i8").tobytes()
        rec += np.ascontiguousarray(counts_LRE, dtype="<i4").tobytes()
        rec += np.ascontiguousarray(dropped_LRE, dtype="<i4").tobytes()
        if len(rec) != self.record_bytes:
            raise ValueError(f"trace record of {len(rec)} bytes, the header says {self.record_bytes}")
        self.f.seek(0, os.SEEK_END)
        self.f.write(rec)
        if self.header["first_step"] is None:
            self.header["first_step"] = step
        self.header["last_step"] = step
        self.f.seek(0)
        self.f.write(_encode(self.header))
        self.f.flush()

    def close(self) -> None:
        """Close the file."""
        self.f.close()


@dataclasses.dataclass
class Trace:
    """A whole trace in memory (S records)."""

    header: Dict[str, Any]
    steps: np.ndarray
    """``[S]`` int64 step numbers."""
    counts_SLRE: np.ndarray
    """``[S, L, R, E]`` int32 rows routed (after capacity)."""
    dropped_SLRE: np.ndarray
    """``[S, L, R, E]`` int32 dropped (token, expert) pairs."""


def read_trace(path: str) -> Trace:
    """Read the trace at ``path`` (a directory means its ``routing_trace.bin``); a torn last record
    (a run killed mid-write) is ignored."""
    if os.path.isdir(path):
        path = trace_path(path)
    h = read_header(path)
    L, R, E = h["num_layers"], h["source_ranks"], h["num_experts"]
    n = (os.path.getsize(path) - HEADER_BYTES) // h["record_bytes"]
    raw = np.fromfile(path, dtype=np.uint8, offset=HEADER_BYTES, count=n * h["record_bytes"]).reshape(n, -1)
    steps = raw[:, :8].copy().view("<i8").reshape(n)
    body = raw[:, 8:].copy().view("<i4").reshape(n, 2, L, R, E)
    return Trace(header=h, steps=steps, counts_SLRE=body[:, 0], dropped_SLRE=body[:, 1])
