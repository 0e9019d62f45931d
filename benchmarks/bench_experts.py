"""Benchmark the grouped-GEMM expert backends: TFLOP/s per backend and precision, and FP8 accuracy.

For each shape ``H,F,E,K,T`` (hidden, expert FFN, experts, top-k, tokens) the layer receives
``N = T·K`` rows spread over the E experts (uneven, multinomial), and one forward + backward of
:class:`folding.moe.experts.grouped.GroupedMLP` is timed. FLOPs = 3 GEMM passes × 2·N·H·3F (fc1 is
H→2F, fc2 F→H). The baseline is a dense matmul of the same FLOPs on the same device
(``[N, H] × [H, 3F]`` forward, input-gradient and weight-gradient products). The report also lists
the layer error of BF16 and of each emulated FP8 recipe against an fp32 layer.

Usage::

    python -m benchmarks.bench_experts                                   # CPU-sized default shapes
    python -m benchmarks.bench_experts --shapes 4096,14336,8,2,4096       # Mixtral 8x7B-like (GPU)
    python -m benchmarks.bench_experts --out benchmarks/results/experts_cpu.md --iters 5

Backends that cannot run here are listed as skipped with the reason.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import torch

from folding.moe.experts.grouped import GroupedMLP
from folding.moe.experts.select import backend_support, resolve_backend
from folding.moe.experts.te import te_available
from folding.quant import RECIPES

DEFAULT_SHAPES = "128,256,8,2,256;256,512,8,2,512"
MIXTRAL_SHAPE = "4096,14336,8,2,4096"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None):
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--shapes",
        default=DEFAULT_SHAPES,
        help=f"';'-separated H,F,E,K,T shapes (default {DEFAULT_SHAPES}; Mixtral-like: {MIXTRAL_SHAPE})",
    )
    p.add_argument("--backends", default="loop,torch,te", help="comma-separated backends to time")
    p.add_argument("--dtypes", default="bf16,fp32", help="comma-separated compute dtypes: bf16, fp32")
    p.add_argument(
        "--fp8-recipes",
        default="",
        help="FP8 recipes to time (te and torch backends, GPU), e.g. tensorwise,mxfp8 or rowwise (torch, Hopper)",
    )
    p.add_argument("--emulated", action="store_true", help="also time the emulated FP8 backend (slow; numerics only)")
    p.add_argument("--iters", type=int, default=3, help="timed iterations per case (after one warm-up)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    p.add_argument("--no-accuracy", action="store_true", help="skip the FP8 accuracy table")
    p.add_argument("--out", default="", help="markdown report path (default: print only)")
    return p.parse_args(argv)


def _load():
    try:
        return " / ".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _counts(n, e, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.multinomial(torch.ones(e), n, replacement=True, generator=g)
    return torch.bincount(idx, minlength=e).to(device)


def _time(fn, iters, device):
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / iters


def bench_layer(shape, backend, dtype, recipe, iters, device):
    """Seconds per forward+backward of one GroupedMLP, or raises with the reason it cannot run."""
    h, f, e, k, t = shape
    n = t * k
    backend = resolve_backend(backend, recipe, device, dtype)  # decided once, before the experts are built
    mod = GroupedMLP(
        num_local_experts=e, hidden_size=h, ffn_hidden_size=f, backend=backend, fp8_recipe=recipe, params_dtype=dtype
    ).to(device)
    counts = _counts(n, e, device)
    x = torch.randn(n, h, dtype=dtype, device=device, requires_grad=True)
    p = torch.rand(n, device=device)
    dy = torch.randn(n, h, dtype=dtype, device=device)

    def step():
        mod(x, counts, p).backward(dy)

    return _time(step, iters, device)


def bench_dense(shape, dtype, iters, device):
    """Seconds for dense matmuls of the same FLOPs as the layer's six GEMMs."""
    h, f, e, k, t = shape
    n = t * k
    a = torch.randn(n, h, dtype=dtype, device=device)
    w = torch.randn(3 * f, h, dtype=dtype, device=device)
    g = torch.randn(n, 3 * f, dtype=dtype, device=device)

    def step():
        a @ w.t()
        g @ w
        g.t() @ a

    return _time(step, iters, device)


def layer_flops(shape):
    """FLOPs of one forward + backward: 3 passes × 2·N·H·3F."""
    h, f, e, k, t = shape
    return 3 * 2 * (t * k) * h * 3 * f


def accuracy_rows(device):
    """Relative layer errors (output, dx, dW1, dW2) against fp32 for bf16 and each emulated recipe."""
    rows = []
    h, f, e = 128, 256, 4
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([100, 0, 37, 119])
    base = torch.randn(int(counts.sum()), h, generator=g)
    probs, dy = torch.rand(base.shape[0], generator=g), torch.randn(base.shape[0], h, generator=g)
    for case in ("gaussian", "outlier tokens x1000"):
        x = base.clone()
        normal = torch.ones(x.shape[0], dtype=torch.bool)
        if case != "gaussian":
            x[::50] *= 1000.0
            normal[::50] = False

        def run(backend, dtype, recipe=None):
            mod = GroupedMLP(
                num_local_experts=e,
                hidden_size=h,
                ffn_hidden_size=f,
                backend=backend,
                fp8_recipe=recipe,
                params_dtype=dtype,
                init_std=0.05,
                init_seed=5,
            )
            xx = x.to(dtype).detach().requires_grad_()
            y = mod(xx, counts, probs)
            y.backward(dy.to(dtype))
            return [y[normal], xx.grad[normal], mod.fc1_weight.grad, mod.fc2_weight.grad]

        ref = run("loop", torch.float32)
        for name, args in [("bf16", ("loop", torch.bfloat16))] + [
            (f"emulated {r}" + (" (first step: scale 1)" if r == "delayed" else ""), ("emulated", torch.bfloat16, r))
            for r in RECIPES
        ]:
            out = run(*args)
            errs = [((a.float() - b).norm() / b.norm()).item() for a, b in zip(out, ref)]
            rows.append((case, name, errs))
    return rows


def main(argv=None):
    """Run the benchmark and print (and optionally write) the markdown report."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";") if s]
    for s in shapes:
        if len(s) != 5:
            raise SystemExit(f"--shapes entry {s} must be H,F,E,K,T (five integers)")
    dev_name = (
        torch.cuda.get_device_name()
        if device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    )
    te_ok, te_why = te_available()
    lines = [
        "# Grouped-GEMM expert benchmark",
        "",
        f"- device: {dev_name}",
        f"- torch: {torch.__version__}; TransformerEngine: {'available' if te_ok else 'unavailable (' + te_why + ')'}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- host load average at start (1/5/15 min): {_load()} on {os.cpu_count()} CPUs "
        "(timings from a loaded host are indicative only)",
        f"- command: `python -m benchmarks.bench_experts {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "- FLOPs per step: forward + backward, 18·N·H·F (N = T·K rows); dense baseline: matmuls of the same FLOPs",
        "",
        "| shape H,F,E,K,T | backend | dtype | fp8 recipe | ms / step | TFLOP/s | dense TFLOP/s | vs dense |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cases = []
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        emulated = args.emulated
        for b in args.backends.split(","):
            if b == "emulated":  # needs a recipe: same as --emulated
                emulated = True
                continue
            cases.append((b, dname, dtype, None))
            if b in ("te", "torch"):  # each backend times the recipes it runs here; the rest are skipped
                cases += [(b, dname, dtype, r) for r in args.fp8_recipes.split(",") if r]
        if emulated:
            cases += [("emulated", dname, dtype, r) for r in (args.fp8_recipes or "mxfp8").split(",") if r]
    skipped = []
    for shape in shapes:
        flops = layer_flops(shape)
        dense = {}
        for backend, dname, dtype, recipe in cases:
            ok, why = backend_support(backend, recipe, device, dtype)
            if not ok:
                skipped.append(f"{backend} {dname}{' ' + recipe if recipe else ''}: {why}")
                continue
            if dname not in dense:
                dense[dname] = flops / bench_dense(shape, dtype, args.iters, device) / 1e12
            sec = bench_layer(shape, backend, dtype, recipe, args.iters, device)
            tf = flops / sec / 1e12
            lines.append(
                f"| {','.join(map(str, shape))} | {backend} | {dname} | {recipe or '-'} | {sec * 1e3:.2f} | "
                f"{tf:.4f} | {dense[dname]:.4f} | {tf / dense[dname]:.2f} |"
            )
            print(lines[-1], flush=True)
    if skipped:
        lines += ["", "Skipped (not available here):", ""] + [f"- {s}" for s in sorted(set(skipped))]
    if not args.no_accuracy:
        lines += [
            "",
            "## Layer error against fp32 (relative Frobenius norm)",
            "",
            "H=128, F=256, 4 experts with 100/0/37/119 rows, bf16 compute. With outlier tokens the output and",
            "dx errors are measured on the other tokens.",
            "",
            "| inputs | precision | output | dx | dW1 | dW2 |",
            "|---|---|---|---|---|---|",
        ]
        for case, name, errs in accuracy_rows(device):
            lines.append(f"| {case} | {name} | " + " | ".join(f"{v:.4f}" for v in errs) + " |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(report)


if __name__ == "__main__":
    main()
