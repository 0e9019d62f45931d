"""A run's directory: its log, its status marker, and what happens to it on failure and resume.

Rank 0 owns the run directory (Hydra's ``hydra.run.dir``, by default ``outputs/<date>/<time>``). In it:

- ``train.log``: every line the run prints on the console (run directory, layout, thread count, each
  step line, evaluations, checkpoints, the stop line) and the engine's log records, appended;
- ``metrics.jsonl`` (``logging.metrics_file``) and ``resolved_config.yaml`` (see the launcher);
- ``status.json``: ``{"status": "running" | "completed" | "stopped" | "failed", "step": ...,
  "checkpoint": ...}``, rewritten atomically when the state changes. A job script tells a clean stop
  (SIGINT/SIGTERM: checkpoint saved, every worker exited 0) from a failure by ``"stopped"`` here, since
  torchrun's own exit status is 1 after any signal.

A run that stops before training (a failed check, a data error, a dry run) removes the directory
Hydra just created if it is still empty. A run resumed from a checkpoint continues in the run
directory that wrote the checkpoint (recorded in it as ``run_dir``) when that directory still exists:
the log and the metrics of one run stay in one place, and the directory Hydra made for the resumed
launch is removed.

Usage::

    log = RunLog(run_dir)                 # rank 0 only
    log.echo("layout: ...")
    write_status(run_dir, "running", step=0)
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, Optional

LOG_FILE = "train.log"
STATUS_FILE = "status.json"
STATUSES = ("running", "completed", "stopped", "failed")


def discard_if_empty(run_dir: str, stop_at: Optional[str] = None) -> bool:
    """Remove ``run_dir`` if it is an empty directory, then its parents while they are empty, up to
    (not including) ``stop_at`` (default: the working directory). Returns whether ``run_dir`` went.
    Never removes a file or a non-empty directory."""
    stop = os.path.abspath(stop_at or os.getcwd())
    path = os.path.abspath(run_dir)
    try:
        os.rmdir(path)  # fails unless it is an empty directory
    except OSError:
        return False
    path = os.path.dirname(path)
    while path != stop and path.startswith(stop + os.sep):
        try:
            os.rmdir(path)
        except OSError:
            break
        path = os.path.dirname(path)
    return True


def write_status(run_dir: str, status: str, **fields: Any) -> str:
    """Write ``status.json`` in ``run_dir`` atomically (a temporary file renamed over it)."""
    if status not in STATUSES:
        raise ValueError(f"status {status!r} is not one of {STATUSES}")
    path = os.path.join(run_dir, STATUS_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"status": status, **fields}, f, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)
    return path


def read_status(run_dir: str) -> Optional[dict]:
    """The parsed ``status.json`` of ``run_dir``, or ``None`` when there is none."""
    try:
        with open(os.path.join(run_dir, STATUS_FILE), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class RunLog:
    """Rank 0's console: each :meth:`echo` line goes to stdout and is appended to ``train.log``; while
    :meth:`capture_records` is active, log records of the ``folding`` loggers are appended too."""

    def __init__(self, run_dir: str, stream=None):
        """Open ``run_dir/train.log`` for appending (the directory is created)."""
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, LOG_FILE)
        self._file = open(self.path, "a", encoding="utf-8")
        self.stream = stream
        self._handler: Optional[logging.Handler] = None

    def echo(self, line: str, *, console: bool = True) -> None:
        """Print ``line`` (unless ``console`` is false) and append it to the log file."""
        if console:
            print(line, file=self.stream or sys.stdout, flush=True)
        self._file.write(line + "\n")
        self._file.flush()

    def capture_records(self) -> None:
        """Append the ``folding`` loggers' records (INFO and above) to the log file."""
        if self._handler is None:
            self._handler = logging.StreamHandler(self._file)
            self._handler.setLevel(logging.INFO)
            self._handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s: %(message)s"))
            logging.getLogger("folding").addHandler(self._handler)

    def close(self) -> None:
        """Detach from the loggers and close the file."""
        if self._handler is not None:
            logging.getLogger("folding").removeHandler(self._handler)
            self._handler = None
        self._file.close()
