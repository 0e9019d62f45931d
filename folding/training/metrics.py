"""Where a run's numbers go: a JSONL file, the console (with a progress bar) and Weights & Biases.

Only rank 0 builds a :class:`MetricsSink`; the other ranks log nothing. The JSONL file gets one
``{"kind": "train", "step": k, ...}`` record per optimizer step (whatever ``logging.interval`` is),
appended and flushed at once, plus records of other kinds (``eval``, ``run``). The console and W&B get
every ``logging.interval``-th step, the last step and every evaluation.

Shape names: L MoE layers, E experts; ``counts_LE`` are tokens routed to each expert of each layer.

Usage::

    sink = MetricsSink(job.logging, run_dir=run_dir, total_steps=job.train.steps, run_config=job.to_dict())
    sink.log({"kind": "train", "step": 1, "loss": 4.2, ...})
    sink.close()
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from ..job.config import LoggingConfig


def expert_load_summary(counts_LE: Sequence[Sequence[float]]) -> Dict[str, List[float]]:
    """Per-layer load statistics from token counts per expert: ``load_min`` / ``load_max`` (fraction of
    the layer's routed tokens going to its least / most loaded expert) and ``load_imbalance``
    (max count ÷ mean count; 1.0 is perfectly balanced)."""
    out: Dict[str, List[float]] = {"load_min": [], "load_max": [], "load_imbalance": []}
    for row in counts_LE:
        total = float(sum(row))
        if total <= 0:
            out["load_min"].append(0.0)
            out["load_max"].append(0.0)
            out["load_imbalance"].append(1.0)
            continue
        out["load_min"].append(min(row) / total)
        out["load_max"].append(max(row) / total)
        out["load_imbalance"].append(max(row) / (total / len(row)))
    return out


def _jsonable(value: Any) -> Any:
    """Non-finite floats become ``null`` (JSON has no NaN); containers are converted recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class JsonlWriter:
    """Appends one JSON object per line to ``path`` (never truncates) and flushes every record."""

    def __init__(self, path: str):
        """Open ``path`` for appending (its directory is created)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: Dict[str, Any]) -> None:
        """Append ``record`` as one line and flush it to the OS."""
        self._file.write(json.dumps(_jsonable(record), sort_keys=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def progress_bar(step: int, total: int, width: int = 24) -> str:
    """``[#######.........]  7/16`` style bar for ``step`` of ``total``."""
    filled = int(width * min(step, total) / max(total, 1))
    return f"[{'#' * filled}{'.' * (width - filled)}] {step:>{len(str(total))}}/{total}"


def format_duration(seconds: float) -> str:
    """``seconds`` as the console's ETA: ``42s``, ``3m07s``, ``5h12m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_train_line(record: Dict[str, Any], total_steps: int, eta_s: Optional[float] = None) -> str:
    """One console line for a ``train`` record (progress bar, losses, speed, memory, load, ETA).

    The model TFLOP/s per device (measured: the model's FLOPs per step over the step's time) and the MFU
    are shown only when the record has an MFU, i.e. a peak is known (``logging.peak_tflops`` or a known
    GPU kind): a CPU run has no such column rather than ``0.000``. ``eta_s``: the seconds left (the
    ``eta`` column, at the end; none when ``None``)."""

    def num(key, fmt):
        v = record.get(key)
        return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)

    imb = record.get("load_imbalance") or []
    parts = [
        progress_bar(record["step"], total_steps),
        f"loss {num('loss', '.4f')}",
        f"lm {num('lm_loss', '.4f')}",
        f"gnorm {num('grad_norm', '.3f')}",
        f"lr {num('lr', '.2e')}",
        f"tok/s {num('tokens_per_s', '.0f')}",
    ]
    if record.get("mfu") is not None:
        parts.append(f"TFLOP/s/dev {num('tflops_per_device', '.1f')} (MFU {record['mfu']:.1%})")
    parts += [
        f"mem {num('mem_gib', '.2f')}GiB",
        f"imb {max(imb):.2f}" if imb else "imb n/a",
        f"drop {num('dropped_fraction', '.3f')}",
    ]
    if "mtp_loss" in record:  # multi-token prediction: its loss next to the LM loss
        parts.insert(3, f"mtp {num('mtp_loss', '.4f')}")
    if eta_s is not None:
        parts.append(f"eta {format_duration(eta_s)}")
    if record.get("skipped"):
        parts.append("SKIPPED (non-finite loss or gradient)")
    return " | ".join(parts)


def drop_replayed_records(path: str, resumed_at: int) -> Optional[int]:
    """Remove from the JSONL file ``path`` every record of a step after ``resumed_at`` (a resumed run replays
    those steps), rewriting it atomically; return the last step it held records for (``None``: no such
    record, or no file). Records without a step (the ``run`` record of each start) stay."""
    if not os.path.exists(path):
        return None
    kept, last = [], None
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                step = json.loads(line).get("step")
            except json.JSONDecodeError:  # a line cut short by the stop: dropped
                continue
            if isinstance(step, int) and step > resumed_at:
                last = step if last is None else max(last, step)
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
    if last is None:
        return None
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return last


class MetricsSink:
    """Rank 0's metrics outputs: JSONL (every record), console and W&B (every ``interval`` steps)."""

    def __init__(
        self,
        config: LoggingConfig,
        *,
        run_dir: str,
        total_steps: int,
        run_config: Optional[Dict[str, Any]] = None,
        stream=None,
        echo=None,
        resumed_at: Optional[int] = None,
    ):
        """``run_dir``: the run's output directory (relative ``metrics_file`` and W&B files go there);
        ``run_config``: the resolved config given to W&B; ``echo``: prints a console line (default:
        ``print`` to ``stream``), called as ``echo(line, console=logging.console)``, e.g. a
        :class:`~folding.launch.run_dir.RunLog`'s, which also appends the line to the run's log.
        ``resumed_at``: the step a resumed run restarts after; the records the file holds for later steps
        (written before the run stopped, and about to be replayed) are removed, and the replayed steps'
        new records carry ``"replayed": true`` (:func:`drop_replayed_records`), so the file keeps one
        record per step."""
        self.config = config
        self.total_steps = total_steps
        self._step_times: List[float] = []  # this run's step times, for the console's ETA
        path = os.path.expanduser(config.metrics_file)
        self.path = path if os.path.isabs(path) else os.path.join(run_dir, path)
        self._replay_until = drop_replayed_records(self.path, resumed_at) if resumed_at is not None else None
        self.jsonl = JsonlWriter(self.path)
        self.stream = stream or sys.stdout
        self.echo = echo or self._print
        self._own_echo = echo is None
        self._wandb = None
        if config.wandb.mode != "disabled":
            import wandb

            self._wandb = wandb.init(
                project=config.wandb.project,
                mode=config.wandb.mode,
                name=config.wandb.name or os.path.basename(os.path.abspath(run_dir)),
                dir=run_dir,
                config=run_config or {},
                reinit="finish_previous",
            )

    def _print(self, line: str, *, console: bool = True) -> None:
        if console:
            print(line, file=self.stream, flush=True)

    def log(self, record: Dict[str, Any]) -> None:
        """Write ``record`` (must carry ``kind``) to the JSONL file, and to console / W&B when due."""
        if "kind" not in record:
            raise ValueError("a metrics record needs a 'kind' field ('train', 'eval', ...)")
        step = record.get("step")
        if self._replay_until is not None and step is not None and step <= self._replay_until:
            record = {**record, "replayed": True}
        self.jsonl.write(record)
        kind, step = record["kind"], record.get("step")
        if kind == "train" and isinstance(record.get("step_time_s"), (int, float)):
            self._step_times.append(float(record["step_time_s"]))
        due = (
            kind != "train"
            or step is None
            or step % self.config.interval == 0
            or step == self.total_steps
            or step == 1
            or record.get("skipped")
        )
        if not due:
            return
        if kind == "train":
            line = format_train_line(record, self.total_steps, eta_s=self.eta_s(step))
        else:
            line = f"[{kind}] " + " ".join(
                f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                for k, v in record.items()
                if k != "kind" and not isinstance(v, list)
            )
        self.echo(line, console=self.config.console)
        if self._wandb is not None:
            flat = {
                f"{kind}/{k}": v
                for k, v in record.items()
                if isinstance(v, (int, float)) and k not in ("kind", "step") and v is not None
            }
            if kind == "train":
                flat.update({f"load/imbalance_layer{i}": v for i, v in enumerate(record.get("load_imbalance", []))})
            self._wandb.log(flat, step=step)

    def eta_s(self, step: Optional[int]) -> Optional[float]:
        """Seconds left after ``step``: the steps still to run times the median time of this run's steps so
        far; ``None`` before any step time or without a step."""
        if step is None or not self._step_times:
            return None
        return max(0, self.total_steps - step) * statistics.median(self._step_times)

    def warn(self, step: int, message: str, **fields: Any) -> None:
        """Write a ``{"kind": "warning", "step", "message", **fields}`` record to the JSONL file and the
        line ``warning: <message>`` to the console (whatever ``logging.interval`` is) and the run's log."""
        self.jsonl.write({"kind": "warning", "step": step, "message": message, **fields})
        self.echo(f"warning: {message}", console=self.config.console)

    def event(self, kind: str, step: int, message: str, **fields: Any) -> None:
        """Write a ``{"kind": kind, "step", "message", **fields}`` record to the JSONL file and the line
        ``message`` to the console (whatever ``logging.interval`` is) and the run's log."""
        self.jsonl.write({"kind": kind, "step": step, "message": message, **fields})
        self.echo(message, console=self.config.console)

    def close(self) -> None:
        """Flush and close the outputs (and finish the W&B run). With a run log (``echo`` given), W&B's
        closing summary goes to the log only, with one console line saying so."""
        self.jsonl.close()
        if self._wandb is not None:
            if self._own_echo:
                self._wandb.finish()
            else:
                text = _captured_fds(self._wandb.finish)
                for line in text.splitlines():
                    self.echo(line, console=False)
                self.echo("W&B run summary and sync command: in train.log", console=self.config.console)
            self._wandb = None


def _captured_fds(fn) -> str:
    """Run ``fn()`` with the process's stdout and stderr file descriptors sent to a temporary file (W&B
    writes below ``sys.stdout``); return what was written there."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        os.dup2(tmp.fileno(), 2)
        try:
            fn()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        tmp.seek(0)
        return tmp.read().decode("utf-8", errors="replace")


class StepTimer:
    """Wall-clock time of one step, with the device synchronized at both ends on GPU."""

    def __init__(self, device):
        """``device``: the training device (``cuda`` is synchronized)."""
        self.device = device
        self.start = time.perf_counter()

    def _sync(self):
        if getattr(self.device, "type", str(self.device)) == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def restart(self) -> None:
        """Start timing now."""
        self._sync()
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since the last restart."""
        self._sync()
        return time.perf_counter() - self.start
