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
  nothing), overlap off and on, and the overlapped step timed whole with a communicator per concurrent
  role and with the groups shared by rank list (:mod:`tools.bringup_overlap_step`).

Every case runs as ``python -m tools.bringup_device_cases CASE`` and prints one line ``RESULT {json}``;
without CUDA it reports ``{"skipped": ...}`` and exits 0. :func:`run_case` runs one in a subprocess and
reads that line back (or the tail of what it printed when it died); :func:`section_lines` turns the
results into the report's lines.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any, Dict, Optional

import torch

from folding.moe.experts.grouped import GroupedMLP
from folding.moe.experts.scaled import TORCH_FP8_RECIPES
from folding.moe.experts.select import backend_support
from tools.bringup_overlap_step import NO_CUDA, overlap_step

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CASES = ("fp8-zero-engine", "fp8-zero-raw", "overlap-step")
ASSERT_MARKS = ("cannot handle delta=0", "device-side assert", "CUDA error: an illegal", "Assertion")
"""Text by which a failed raw call is recognised as the kernel's assert."""


# ------------------------------------------------------------------------------- the two FP8 cases


def fp8_zero_engine(counts=(128, 0, 64, 0), hidden: int = 256, ffn: int = 512) -> Dict[str, Any]:
    """Forward + backward of the ``torch`` backend's FP8 experts with zero-row experts, per recipe."""
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
    steps = res.get("step_ms_by_rank")
    if steps:
        shared_exposed = sum(v["total_ms"] for v in res.get("exposed_on_shared", {}).values())
        lines += [
            "",
            "The overlapped step with a communicator per concurrent role (as the trainer builds the groups) and "
            f"with the groups shared by rank list, ms per rank: {steps['own_communicators']} and "
            f"{steps['shared']} (rank 0's exposed ms with shared groups: {shared_exposed:.2f}).",
        ]
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
        result = overlap_step(args.world, cpu=args.cpu)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
