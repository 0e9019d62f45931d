"""Start-up time: seconds from the command to the first training step of the README's demo, and to the end of
each tool, for this tree and (``--compare``) another checkout of the project, measured alternately in one run.

Each command runs as a user runs it, in a fresh process (under ``torchrun`` for the demo), from an empty
directory, with ``PYTHONPATH`` naming the tree under test (so its ``folding``, ``tools`` and ``examples`` are
the ones that run; the report names the ``folding`` each tree imported). The demo's time is until rank 0
prints its first step's line (the run is then stopped); a tool's, until it exits. The trees take turns
command by command, so both see the same host load; medians of ``--repeats`` runs.

Usage::

    python -m benchmarks.startup --out benchmarks/results/startup_cpu.md                  # this tree
    python -m benchmarks.startup --compare /path/to/older/checkout --out benchmarks/results/startup_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_STEP = re.compile(rb"\b1/\d+ \| loss")
"""Rank 0's console line of step 1 (``[###...] 1/60 | loss ...``)."""

DEMO = ["parallel.tp=2", "parallel.ep=4", "parallel.etp=1", "logging.wandb.mode=disabled"]
"""The README's main command's overrides (wandb off: no network here)."""


def commands(root: str) -> List[Tuple[str, List[str], bool]]:
    """``(name, argv, until_first_step)`` of every measured command for the tree at ``root``."""
    script = os.path.join(root, "examples", "pretrain_mixtral.py")
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", script]
    return [
        ("demo: torchrun 4 ranks, to the first step", run + DEMO, True),
        ("demo: 1 process, to the first step", [sys.executable, script, "logging.wandb.mode=disabled"], True),
        (
            "dry run (recipes=qwen3_30b_a3b)",
            [sys.executable, script, "recipes=qwen3_30b_a3b", "train.dry_run=true"],
            False,
        ),
        ("refused override (train.stpes=3)", [sys.executable, script, "train.stpes=3"], False),
        (
            "tools.plan --model qwen3_30b_a3b --world 64 --seq-length 4096 --global-batch-size 512",
            [sys.executable, "-m", "tools.plan", "--model", "qwen3_30b_a3b", "--world", "64"]
            + ["--seq-length", "4096", "--global-batch-size", "512"],
            False,
        ),
        (
            "tools.layout --world 64 --tp 2 --ep 8",
            [sys.executable, "-m", "tools.layout", "--world", "64", "--tp", "2", "--ep", "8"],
            False,
        ),
        (
            "tools.megatron_args (Mixtral 8x7B flags)",
            [sys.executable, "-m", "tools.megatron_args", "--world-size", "64", *MIXTRAL_FLAGS],
            False,
        ),
    ]


MIXTRAL_FLAGS = (
    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups 8 --seq-length 4096 --max-position-embeddings 32768 --normalization RMSNorm "
    "--swiglu --disable-bias-linear --untie-embeddings-and-output-weights --position-embedding-type rope "
    "--num-experts 8 "
    "--moe-router-topk 2 --moe-token-dispatcher-type alltoall --moe-grouped-gemm --bf16 "
    "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8 "
    "--micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000"
).split()


def _env(root: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=root + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return env


def time_command(root: str, argv: Sequence[str], until_first_step: bool, timeout_s: float = 600.0) -> float:
    """Seconds from starting ``argv`` (in an empty directory, with ``root`` first on ``PYTHONPATH``) to rank 0's
    first step line (then the run is stopped) or to the process's exit. A command that fails raises."""
    with tempfile.TemporaryDirectory() as cwd:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            argv, cwd=cwd, env=_env(root),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        out = b""
        try:
            if until_first_step:
                while True:
                    chunk = proc.stdout.read1(65536)
                    if not chunk:
                        raise RuntimeError(f"{' '.join(argv)} ended before its first step:\n{out[-3000:].decode()}")
                    out += chunk
                    if FIRST_STEP.search(out):
                        return time.perf_counter() - t0
                    if time.perf_counter() - t0 > timeout_s:
                        raise TimeoutError(f"{' '.join(argv)}: no first step in {timeout_s} s")
            out = proc.communicate(timeout=timeout_s)[0]
            elapsed = time.perf_counter() - t0
            if proc.returncode not in (0, 2) or (proc.returncode == 2 and "stpes" not in " ".join(argv)):
                raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{out[-3000:].decode()}")
            return elapsed
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def imported_from(root: str) -> str:
    """Which tree's ``folding`` a process started with ``root``'s environment imports: ``root``'s (named by its
    commit), or the path it found instead (a wrong measurement, said in the report)."""
    out = subprocess.run(
        [sys.executable, "-c", "import folding, os; print(os.path.dirname(folding.__file__))"],
        cwd=tempfile.gettempdir(), env=_env(root), capture_output=True, text=True, check=True,
    )  # fmt: skip
    found = os.path.dirname(out.stdout.strip())
    if os.path.realpath(found) != os.path.realpath(root):
        return f"another tree's ({found})"
    commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"its own (commit {commit.stdout.strip() or 'unknown'})"


def measure(roots: Dict[str, str], repeats: int) -> Dict[str, Dict[str, List[float]]]:
    """``{command name: {tree label: [seconds per run]}}``, the trees alternating per run."""
    names = [name for name, _, _ in commands(ROOT)]
    times: Dict[str, Dict[str, List[float]]] = {n: {label: [] for label in roots} for n in names}
    for r in range(repeats):
        for i, name in enumerate(names):
            for label, root in roots.items():
                _, argv, first = commands(root)[i]
                t = time_command(root, argv, first)
                times[name][label].append(t)
                print(f"run {r + 1}/{repeats}  {label:7s} {t:7.2f} s  {name}", flush=True)
    return times


def _shown(argv: Sequence[str]) -> List[str]:
    """``argv`` with the compared checkout's path replaced by a placeholder (the report names its commit)."""
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a == "--compare":
            out[i + 1] = "OLDER_CHECKOUT"
    return out


def report(times, roots: Dict[str, str], repeats: int, load: Tuple[tuple, tuple], argv: Sequence[str]) -> str:
    """The Markdown report: medians per command and tree, and the ratio to the compared tree."""
    labels = list(roots)
    lines = [
        "# Start-up time on CPU",
        "",
        f"Measured {datetime.date.today().isoformat()} on {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}; load average before {load[0]}, after {load[1]}.",
        "",
        f"Command: `python -m benchmarks.startup {' '.join(_shown(argv))}`",
        "",
        "Trees: "
        + "; ".join(f"{label} imports `folding` from `{imported_from(root)}`" for label, root in roots.items()),
        "",
        "Seconds from the command to rank 0's first step line (demo) or to the process's exit (the rest), "
        f"median of {repeats} runs, the trees alternating command by command.",
        "",
    ]
    head = "| command | " + " | ".join(f"{label} (s)" for label in labels)
    rule = "|---|" + "---|" * len(labels)
    if len(labels) == 2:
        head, rule = head + f" | {labels[0]} / {labels[1]}", rule + "---|"
    lines += [head + " |", rule]
    for name, per in times.items():
        med = [statistics.median(per[label]) for label in labels]
        row = f"| {name} | " + " | ".join(f"{m:.2f}" for m in med)
        if len(labels) == 2:
            row += f" | {med[0] / med[1]:.2f}"
        lines.append(row + " |")
    lines += ["", "Every run (s):", ""]
    for name, per in times.items():
        lines.append(
            f"- {name}: " + "; ".join(f"{label} {', '.join(f'{t:.2f}' for t in per[label])}" for label in labels)
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Measure, print and write the report."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compare", default=None, help="another checkout of the project, measured as 'before'")
    p.add_argument("--repeats", type=int, default=3, help="runs per command and tree (median reported)")
    p.add_argument("--out", default=None, help="write the Markdown report here")
    args = p.parse_args(argv)
    roots = {"this": ROOT} if args.compare is None else {"before": os.path.abspath(args.compare), "after": ROOT}
    load0 = tuple(round(x, 2) for x in os.getloadavg())
    times = measure(roots, args.repeats)
    load1 = tuple(round(x, 2) for x in os.getloadavg())
    text = report(times, roots, args.repeats, (load0, load1), sys.argv[1:] if argv is None else list(argv))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
