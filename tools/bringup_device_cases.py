"""Bring-up cases only a GPU can confirm (section 5 of :mod:`tools.gpu_bringup`), each in a subprocess.

What NCCL and CUDA do that the CPU test doubles only model:

- ``fp8-zero-engine``: the engine's padded FP8 path (``torch`` backend, each FP8 recipe this GPU runs)
  forward + backward with experts of zero rows, under ``CUDA_LAUNCH_BLOCKING=1`` so that a device
  assert surfaces at the call that raised it;
- ``fp8-zero-raw``: the raw ``torch._scaled_grouped_mm`` 2-D × 2-D (weight-gradient) call with a
  group of zero rows, rowwise, in a process of its own (a device assert poisons the CUDA context for
  the rest of the process): whether this torch build asserts ("CUTLASS cannot handle delta=0");
- ``overlap-step``: a training step with ``parallel.overlap_moe_comm`` on (EP over up to 4 GPUs, one
  process each; EP 1 on a one-GPU box), first with ``torch.cuda.set_sync_debug_mode("warn")``,
  every synchronization CUDA reports counted by its call site in the engine (the warning's Python
  stack), then with each exchange's exposed time measured by CUDA events on the compute stream around
  its wait (on NCCL, ``Work.wait()`` makes the stream wait and returns at once: a host timer sees
  nothing), overlap off and on.

Every case runs as ``python -m tools.bringup_device_cases CASE`` and prints one line ``RESULT {json}``;
without CUDA it reports ``{"skipped": ...}`` and exits 0. :func:`run_case` runs one in a subprocess and
reads that line back (or the tail of what it printed when it died); :func:`section_lines` turns the
results into the report's lines.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CASES = ("fp8-zero-engine", "fp8-zero-raw", "overlap-step")
NO_CUDA = "no CUDA device visible (a GPU-only case)"
ASSERT_MARKS = ("cannot handle delta=0", "device-side assert", "CUDA error: an illegal", "Assertion")
"""Text by which a failed raw call is recognised as the kernel's assert."""


# ------------------------------------------------------------------------------- the two FP8 cases


def fp8_zero_engine(counts=(128, 0, 64, 0), hidden: int = 256, ffn: int = 512) -> Dict[str, Any]:
    """Forward + backward of the ``torch`` backend's FP8 experts with zero-row experts, per recipe."""
    from folding.moe.expert_scaled import TORCH_FP8_RECIPES
    from folding.moe.expert_select import backend_support
    from folding.moe.experts import GroupedMLP

    if not torch.cuda.is_available():
        return {"skipped": NO_CUDA}
    dev = torch.device("cuda", 0)
    out = {"launch_blocking": os.environ.get("CUDA_LAUNCH_BLOCKING"), "counts": list(counts), "recipes": {}}
    for recipe in TORCH_FP8_RECIPES:
        ok, why = backend_support("torch", recipe, dev, torch.bfloat16)
        if not ok:
            out["recipes"][recipe] = {"run": False, "why": why}
            continue
        mod = GroupedMLP(
            backend="torch",
            fp8_recipe=recipe,
            num_local_experts=len(counts),
            hidden_size=hidden,
            ffn_hidden_size=ffn,
            params_dtype=torch.bfloat16,
            init_seed=3,
            device=dev,
        )
        x = torch.randn(sum(counts), hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
        probs = torch.rand(sum(counts), device=dev)
        y = mod(x, list(counts), probs)
        y.float().square().sum().backward()
        torch.cuda.synchronize(dev)
        grads = [x.grad, mod.fc1_weight.grad, mod.fc2_weight.grad]
        finite = all(bool(torch.isfinite(g).all()) for g in grads) and bool(torch.isfinite(y).all())
        # an expert without rows gets a zero weight gradient
        empty = [e for e, n in enumerate(counts) if n == 0]
        zero = all(float(mod.fc1_weight.grad[e].abs().max()) == 0.0 for e in empty)
        out["recipes"][recipe] = {"run": True, "finite": finite, "empty_experts_zero_grad": zero}
    return out


def fp8_zero_raw(counts=(64, 0, 32), rows_out: int = 64, cols_in: int = 64) -> Dict[str, Any]:
    """The raw 2-D × 2-D rowwise ``torch._scaled_grouped_mm`` with a zero group; raises what it raises."""
    if not torch.cuda.is_available():
        return {"skipped": NO_CUDA}
    op = getattr(torch, "_scaled_grouped_mm", None)
    if op is None:
        return {"skipped": f"torch {torch.__version__} has no torch._scaled_grouped_mm"}
    dev = torch.device("cuda", 0)
    if torch.cuda.get_device_capability(dev)[0] != 9:
        return {"skipped": f"rowwise needs compute capability 9.x, this GPU is {torch.cuda.get_device_capability(dev)}"}
    n, L = sum(counts), len(counts)
    e4m3 = torch.float8_e4m3fn
    a_ON = torch.randn(rows_out, n, device=dev).to(e4m3)  # [O, N] row-major
    b_NI = torch.randn(cols_in, n, device=dev).to(e4m3).t()  # [N, I] column-major
    offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    sa = torch.ones(L * rows_out, device=dev)
    sb = torch.ones(L * cols_in, device=dev)
    y = op(a_ON, b_NI, sa, sb, offs=offs, out_dtype=torch.bfloat16)
    torch.cuda.synchronize(dev)
    return {"counts": list(counts), "shape": list(y.shape), "asserted": False, "torch": torch.__version__}


def classify_raw(returncode: int, result: Optional[dict], output: str) -> str:
    """One sentence on the raw call's outcome from its subprocess's exit status, result and output."""
    if result is not None and "skipped" in result:
        return f"not run: {result['skipped']}"
    if returncode == 0 and result is not None:
        return f"no assert: this torch build ({result.get('torch')}) accepts a zero group in the 2-D × 2-D call"
    if any(mark in output for mark in ASSERT_MARKS):
        return "ASSERTS: this torch build's kernel fails on a zero group (the engine's padding is needed)"
    return f"failed otherwise (exit status {returncode}): see the output"


# ------------------------------------------------------------------------- syncs by call site


@contextlib.contextmanager
def captured_warnings() -> Any:
    """Record every warning raised inside the block with the Python stack that raised it: a list of
    ``(message, [FrameSummary, ...])`` (innermost last)."""
    records: List[tuple] = []
    old = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        records.append((str(message), traceback.extract_stack()[:-1]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        try:
            yield records
        finally:
            warnings.showwarning = old


def call_site(stack, root: str = ROOT) -> str:
    """The engine line a warning came from: the innermost frame under ``root/folding``, else the
    innermost under ``root`` outside this module, as ``path:line (function)``; ``"?"`` if none."""
    here = os.path.abspath(__file__)
    inside = [f for f in stack if os.path.abspath(f.filename).startswith(root + os.sep)]
    inside = [f for f in inside if os.path.abspath(f.filename) != here]
    engine = [f for f in inside if os.path.relpath(os.path.abspath(f.filename), root).startswith("folding" + os.sep)]
    pick = (engine or inside or [None])[-1]
    if pick is None:
        return "?"
    return f"{os.path.relpath(os.path.abspath(pick.filename), root)}:{pick.lineno} ({pick.name})"


def sync_sites(records, root: str = ROOT) -> Dict[str, int]:
    """Count the synchronization warnings of :func:`captured_warnings` by :func:`call_site`."""
    by = collections.Counter()
    for message, stack in records:
        if "synchroniz" in message.lower():
            by[call_site(stack, root)] += 1
    return dict(by.most_common())


# --------------------------------------------------------------------- exchanges by CUDA events


class _TimedWork:
    """A collective's work whose wait is bracketed by events on the current stream (see below)."""

    def __init__(self, work, before=None, after=None):
        self.work, self.before, self.after = work, before, after

    def wait(self):
        if self.before is not None:
            self.before.record()
        out = self.work.wait()
        if self.after is not None:
            self.after.record()
        return out


@contextlib.contextmanager
def exchange_events(event_factory: Optional[Callable[[], Any]] = None) -> Any:
    """Inside the block, every :class:`folding.parallel.overlap.Exchange` records an event on the
    current stream just before its first collective's wait (after any hand-over to the other lane)
    and one just after its last: the time between them on the device is how long the compute stream
    stood waiting for the exchange, its exposed time. Yields a list of ``(what, before, after)``;
    read them with ``before.elapsed_time(after)`` once the device is synchronized."""
    from folding.parallel import overlap

    if event_factory is None:

        def event_factory():
            return torch.cuda.Event(enable_timing=True)

    log: List[tuple] = []
    init = overlap.Exchange.__init__

    def timed_init(self, works, *args, **kwargs):
        init(self, works, *args, **kwargs)
        if self.works:
            before, after = event_factory(), event_factory()
            last = len(self.works) - 1
            self.works = [
                _TimedWork(w, before if i == 0 else None, after if i == last else None)
                for i, w in enumerate(self.works)
            ]
            log.append((self.what, before, after))

    overlap.Exchange.__init__ = timed_init
    try:
        yield log
    finally:
        overlap.Exchange.__init__ = init


def exposed_by_exchange(log) -> Dict[str, Dict[str, float]]:
    """Per exchange name: count, total and largest exposed milliseconds of :func:`exchange_events`."""
    out: Dict[str, Dict[str, float]] = {}
    for what, before, after in log:
        ms = float(before.elapsed_time(after))
        row = out.setdefault(what, {"count": 0, "total_ms": 0.0, "max_ms": 0.0})
        row["count"] += 1
        row["total_ms"] += ms
        row["max_ms"] = max(row["max_ms"], ms)
    return out


# ------------------------------------------------------------------------------- subprocess glue


def run_case(case: str, *, timeout_s: float = 300.0, env: Optional[dict] = None, extra=()) -> tuple:
    """Run ``case`` as ``python -m tools.bringup_device_cases CASE [extra...]`` in a subprocess; return
    ``(exit status, result dict or None, combined output)``."""
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    if case in ("fp8-zero-engine", "fp8-zero-raw"):
        full["CUDA_LAUNCH_BLOCKING"] = "1"
    full.update(env or {})
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tools.bringup_device_cases", case, *extra],
            cwd=ROOT,
            env=full,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as e:
        return 124, None, f"timed out after {timeout_s:.0f} s\n{e.stdout or ''}{e.stderr or ''}"
    output = proc.stdout + proc.stderr
    return proc.returncode, parse_result(proc.stdout), output


def parse_result(stdout: str) -> Optional[dict]:
    """The JSON of the last ``RESULT`` line of a case's output, or None."""
    found = None
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            found = json.loads(line[len("RESULT ") :])
    return found


SYNC_STDERR = "called a synchronizing CUDA operation"
"""Text of CUDA's sync warning: those raised outside Python (autograd's device threads) reach stderr only."""


def section_lines(engine: tuple, raw: tuple, step: tuple) -> tuple:
    """``(ok, markdown lines)`` of the report's section from the three cases' :func:`run_case` results.
    ``ok``: the engine's FP8 case and the overlap step ran (or were skipped for want of CUDA) without
    failing; the raw call's outcome is a fact about the torch build, reported, not judged."""
    ok = True
    lines = ["### FP8 grouped GEMM with experts of zero rows (engine, `CUDA_LAUNCH_BLOCKING=1`)", ""]
    rc, res, out = engine
    if res is None or rc != 0:
        ok = False
        lines += [f"FAILED (exit status {rc}):", "", "```", *out.strip().splitlines()[-25:], "```"]
    elif "skipped" in res:
        lines.append(f"Not run: {res['skipped']}.")
    else:
        lines += [f"Rows per expert {res['counts']}; forward + backward of the `torch` backend's FP8 experts.", ""]
        lines += ["| recipe | ran | finite | zero-row experts' weight gradient zero |", "|---|---|---|---|"]
        for recipe, r in res["recipes"].items():
            if not r["run"]:
                lines.append(f"| {recipe} | no: {r['why']} | | |")
                continue
            ok &= r["finite"] and r["empty_experts_zero_grad"]
            lines.append(f"| {recipe} | yes | {r['finite']} | {r['empty_experts_zero_grad']} |")
    rc, res, out = raw
    lines += ["", "### Raw `torch._scaled_grouped_mm` 2-D × 2-D with a zero group (own process)", ""]
    lines.append(classify_raw(rc, res, out) + ".")
    if rc != 0 and res is None:
        lines += ["", "```", *out.strip().splitlines()[-15:], "```"]
    rc, res, out = step
    lines += ["", "### A training step with overlap on: synchronizations and exposed exchanges", ""]
    if res is None or rc != 0:
        return False, lines + [f"FAILED (exit status {rc}):", "", "```", *out.strip().splitlines()[-25:], "```"]
    if "skipped" in res:
        return ok, lines + [f"Not run: {res['skipped']}."]
    lines.append(f"{res['world']} rank(s) on {res['device']}, EP {res['ep']}.")
    sites = res.get("syncs_by_site")
    if sites is None:
        lines += ["", "Synchronizations: counted by CUDA only on a GPU (not measured here)."]
    else:
        lines += ["", f"Synchronizations CUDA reported in one step, with a Python stack: {sum(sites.values())}", ""]
        lines += ["| call site | count |", "|---|---|"] + [f"| {k} | {n} |" for k, n in sites.items()]
        lines += ["", f"Reported outside Python (stderr, no stack; autograd's threads): {out.count(SYNC_STDERR)}."]
    lines += ["", "Exposed time per exchange, measured on the compute stream (rank 0, one step):", ""]
    lines += ["| exchange | count off / on | total ms off / on | largest ms off / on |", "|---|---|---|---|"]
    off, on = res["exposed_off"], res["exposed_on"]
    for what in sorted(set(off) | set(on)):
        a, b = off.get(what, {}), on.get(what, {})

        def cell(key, fmt):
            return " / ".join(format(x.get(key, 0), fmt) for x in (a, b))

        lines.append(f"| {what} | {cell('count', 'd')} | {cell('total_ms', '.2f')} | {cell('max_ms', '.2f')} |")
    if not off and not on:
        lines.append("| (none: one EP rank exchanges nothing; the case needs 2 or more GPUs) | | | |")
    totals = res.get("exposed_total_ms_by_rank", {})
    lines += ["", f"Every rank's total exposed ms, off: {totals.get('off')}, on: {totals.get('on')}."]
    return ok, lines


def main(argv=None) -> int:
    """Run one case in this process and print ``RESULT {json}`` (exit 0; a failure raises)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("case", choices=CASES, help="the case to run")
    p.add_argument("--world", type=int, default=None, help="overlap-step: GPUs (default: up to 4 visible)")
    p.add_argument("--cpu", action="store_true", help="overlap-step on gloo CPU ranks (the smoke run)")
    args = p.parse_args(argv)
    if args.case == "fp8-zero-engine":
        result = fp8_zero_engine()
    elif args.case == "fp8-zero-raw":
        result = fp8_zero_raw()
    else:
        from tools.bringup_overlap_step import overlap_step

        result = overlap_step(args.world, cpu=args.cpu)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
