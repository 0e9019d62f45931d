"""One-shot bring-up of a GPU box: the pre-flight check, the experts' numerics per backend × recipe,
MoE-layer speed against transformers, and a short training run, in one report.

Run it through ``tools/gpu_bringup.sh`` (which installs the wheels a bare box lacks and bounds the time):

    bash tools/gpu_bringup.sh --prepare                 # on a machine with network: fill .whl/
    bash tools/gpu_bringup.sh [--out DIR]               # on the GPU box: writes DIR/gpu_bringup.md
    bash tools/gpu_bringup.sh --cpu-smoke --out DIR     # the same logic on CPU at toy sizes (CI)

or directly, where hydra-core and omegaconf are importable: ``python -m tools.gpu_bringup --out DIR``.

Sections (each one a function of :mod:`tools.bringup_cases`, run in order; the report is rewritten
after every section, so that a section that fails or runs out of time leaves the others in it):

1. ``tools.gpu_check`` in a subprocess (device, collectives, backends, host↔device transfers);
2. expert numerics: every supported backend × FP8 recipe against fp32, FP8 against its emulation;
3. MoE layer forward + backward at H 4096, E 8 and 64, top-2 and top-8, BF16 vs FP8 ``--fp8-recipe``
   on the ``torch`` backend, and transformers' ``MixtralSparseMoeBlock`` on the same shapes;
4. 20 steps of the training job (2 Mixtral-8x7B layers, sequence 4096, BF16) with tokens/s, MFU, peak
   memory and the host synchronizations CUDA reports;
5. what only a GPU confirms (:mod:`tools.bringup_device_cases`, each case in a subprocess): the FP8
   grouped GEMM with experts of zero rows under ``CUDA_LAUNCH_BLOCKING=1`` (the engine's padded path,
   and the raw ``torch._scaled_grouped_mm`` 2-D × 2-D call: does this torch build assert?), the
   synchronizations of a training step with overlap on by call site, and each exchange's exposed
   time measured with CUDA events (on NCCL ``wait()`` does not block the host). Run it alone with
   ``--only 5`` when the earlier sections leave it too little time.

A section whose turn comes with less than its expected time left before ``--deadline-s`` is reported
as not run. Exit status 0 when every section that ran passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist

from folding.parallel.groups import release_process_groups
from tools import bringup_cases as cases
from tools import bringup_device_cases as device_cases

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _gpu_check(dev, sizes, dtype, args) -> tuple[bool, list[str]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=args.check_timeout_s,
    )
    out = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode == 0, [f"exit status {proc.returncode}", "", "```", *out[-80:], "```"]


def _numerics(dev, sizes, dtype, args):
    return True, cases.expert_numerics(dev, sizes, dtype)


def _speed(dev, sizes, dtype, args):
    if not dist.is_initialized():  # a 1-rank world for the layer's groups; the training run makes its own
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        return True, cases.moe_layer_speed(dev, sizes, dtype, args.fp8_recipe)
    finally:
        release_process_groups()  # frees the groups' native threads before exit


def _device_cases(dev, sizes, dtype, args):
    """The cases only a GPU confirms, each in a subprocess (:mod:`tools.bringup_device_cases`)."""
    timeout = args.check_timeout_s
    engine = device_cases.run_case("fp8-zero-engine", timeout_s=timeout)
    raw = device_cases.run_case("fp8-zero-raw", timeout_s=timeout)
    step = device_cases.run_case("overlap-step", timeout_s=2 * timeout, extra=["--cpu"] if args.cpu_smoke else [])
    return device_cases.section_lines(engine, raw, step)


def _training(dev, sizes, dtype, args):
    lines = cases.training_run(dev, sizes, os.path.join(args.out, "train_run"))
    return lines[0].split("exit status ")[1].startswith("0,"), lines


SECTIONS = (
    ("Pre-flight check (`python -m tools.gpu_check`)", _gpu_check, 150),
    ("Expert numerics per backend × recipe", _numerics, 30),
    ("MoE layer speed", _speed, 90),
    ("Training run", _training, 150),
    ("What only a GPU confirms: empty FP8 experts, syncs and exposed exchanges with overlap", _device_cases, 120),
)
"""``(title, function, expected seconds on the GPU box)`` in run order."""


def _header(dev: torch.device, args, started: str) -> list[str]:
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (smoke run: toy sizes)"
    cap = "sm_%d%d" % torch.cuda.get_device_capability(dev) if dev.type == "cuda" else "-"
    return [
        "# GPU bring-up report",
        "",
        f"- device: {name} ({cap}); torch {torch.__version__}, CUDA {torch.version.cuda}; "
        f"Python {sys.version.split()[0]}",
        f"- started: {started} UTC; command: `python -m tools.gpu_bringup {' '.join(args.argv)}`",
        f"- FP8 recipe of the speed cases: `{args.fp8_recipe}` on the `torch` backend",
        "",
    ]


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; ``only`` becomes a set of section numbers (``None``: every section), and
    ``argv`` the arguments as given (for the report's header)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results", help="folder of the report (gpu_bringup.md) and the run")
    p.add_argument("--cpu-smoke", action="store_true", help="toy sizes on CPU: the script's logic, not a measurement")
    p.add_argument("--fp8-recipe", default="rowwise", help="FP8 recipe of the speed cases (torch backend)")
    p.add_argument("--deadline-s", type=float, default=450.0, help="no section starts past its expected time")
    p.add_argument("--check-timeout-s", type=float, default=150.0)
    p.add_argument("--only", default=None, help=f"comma-separated section numbers (1-{len(SECTIONS)}) to run")
    args = p.parse_args(argv)
    args.argv = argv
    if args.only is not None:
        try:
            only = {int(x) for x in args.only.split(",")}
        except ValueError:
            only = {0}
        if not only <= set(range(1, len(SECTIONS) + 1)):
            p.error(f"--only {args.only}: give section numbers from 1 to {len(SECTIONS)}, comma-separated")
        args.only = only
    return args


def main(argv=None) -> int:
    """Run the sections in order within the deadline; write ``--out``/gpu_bringup.md after each."""
    args = parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("error: no CUDA device visible; run with --cpu-smoke to check the script on CPU", file=sys.stderr)
        return 2
    dev = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", 0)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    sizes = cases.cpu_sizes() if args.cpu_smoke else cases.gpu_sizes()
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_bringup.md")
    t0 = time.monotonic()
    report = _header(dev, args, f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}")
    only = args.only
    failed = False
    for i, (title, fn, expected_s) in enumerate(SECTIONS, 1):
        if only is not None and i not in only:
            continue
        left = args.deadline_s - (time.monotonic() - t0)
        report += [f"## {i}. {title}", ""]
        if not args.cpu_smoke and left < expected_s:
            report += [f"Not run: {left:.0f} s left of the deadline, the section needs about {expected_s} s.", ""]
            continue
        start = time.monotonic()
        try:
            ok, lines = fn(dev, sizes, dtype, args)
        except Exception:  # noqa: BLE001 - one failing section must not lose the others
            ok, lines = False, ["FAILED:", "", "```", *traceback.format_exc().splitlines()[-30:], "```"]
        failed |= not ok
        report += lines + ["", f"({'passed' if ok else 'FAILED'} in {time.monotonic() - start:.1f} s)", ""]
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(report))
        print(f"[gpu_bringup] section {i} {'ok' if ok else 'FAILED'} ({time.monotonic() - t0:.0f} s)", flush=True)
    report.append(f"Total: {time.monotonic() - t0:.0f} s.")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(report) + "\n")
    print(f"[gpu_bringup] report: {path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
