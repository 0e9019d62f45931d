"""GPU mode of the training benchmark: MFU of Mixtral-8x7B-shaped layers on one GPU, BF16 and FP8.

Measured on one CUDA device (``python -m benchmarks.bench_train --mode gpu``):

1. the peak: the best of a few large dense matmuls (``8192^3``) in BF16, and in FP8 (e4m3,
   ``torch._scaled_mm`` with tensorwise scales) where this torch and GPU support it;
2. one Mixtral-8x7B MoE layer (H=4096, F=14336, 8 experts, top-2) on ``--tokens`` tokens: forward +
   backward time and MFU = model FLOPs / time / measured peak of the same dtype;
3. ``--layers`` full transformer layers of Mixtral-8x7B (attention + MoE, sequence ``--seq``), same.

FP8 runs the experts with the ``te`` backend (TransformerEngine ``GroupedLinear``) under the
``--fp8-recipe`` recipe; without TransformerEngine the FP8 rows say why they were skipped. MFU
counts model FLOPs only (``folding.planning.flops``; 3 x forward), never recompute.

Usage::

    python -m benchmarks.bench_train --mode gpu --out benchmarks/results/gpu_mfu_h100.md
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch

from folding.model.block import TransformerLayer
from folding.model.moe_block import default_moe_factory
from folding.model.presets import get_preset
from folding.model.rope import rope_cos_sin
from folding.moe.experts.te import fp8_region
from folding.moe.layer import build_moe_layer
from folding.moe.settings import LayerSettings
from folding.parallel.groups import ProcessGroups
from folding.planning.flops import flops_per_token


def _time(fn, iters: int) -> float:
    """Median seconds of ``fn()`` over ``iters`` CUDA-synchronized runs (two warm-ups)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        ts.append(start.elapsed_time(end) / 1e3)
    return sorted(ts)[len(ts) // 2]


def matmul_peak(dtype: str, n: int = 8192, iters: int = 10):
    """Measured FLOP/s of an ``n^3`` matmul in ``dtype`` (``bf16`` or ``fp8``), or ``(None, why)``."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    if dtype == "bf16":
        return 2 * n**3 / _time(lambda: a @ b, iters), ""
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return None, f"torch {torch.__version__} has no _scaled_mm / float8_e4m3fn"
    try:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major second operand
        one = torch.ones((), device="cuda")
        return 2 * n**3 / _time(
            lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), iters
        ), ""
    except Exception as e:  # noqa: BLE001 - an unsupported GPU or build: report why
        return None, f"FP8 matmul unavailable on {torch.cuda.get_device_name()}: {e}"


def moe_layer_case(a, fp8_recipe):
    """Forward + backward seconds and model FLOPs of one Mixtral-8x7B MoE layer on ``a.tokens`` tokens."""
    import torch.distributed as dist

    cfg = get_preset("mixtral_8x7b")
    world = dist.group.WORLD
    moe_cfg = cfg.moe.replace(aux_loss_coeff=0.0, fp8_recipe=fp8_recipe, expert_backend="te" if fp8_recipe else "auto")
    layer = build_moe_layer(
        config=moe_cfg,
        hidden_size=cfg.hidden_size,
        groups=ProcessGroups(tp=world, tp_cp=world, tp_dp_cp=world, ep=world, etp=world),
        settings=LayerSettings(params_dtype=torch.bfloat16, device="cuda"),
    )
    x = torch.randn(a.tokens, 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        with fp8_region(fp8_recipe, amax_reduction_group=None):  # one region per forward, as a model chunk
            y = layer(x)
        y.sum().backward()

    H, F, k, E = cfg.hidden_size, cfg.moe.ffn_hidden_size, cfg.moe.topk, cfg.moe.num_experts
    flops = 3 * a.tokens * (2 * k * 3 * H * F + 2 * H * E)
    return _time(step, a.iters), flops


def layers_case(a, fp8_recipe):
    """Forward + backward seconds and model FLOPs of ``a.layers`` Mixtral-8x7B layers at ``a.seq`` tokens."""
    moe = {"aux_loss_coeff": 0.0}
    if fp8_recipe:
        moe.update(fp8_recipe=fp8_recipe, expert_backend="te")
    cfg = get_preset("mixtral_8x7b", num_layers=a.layers, moe=moe)
    groups = ProcessGroups.single()

    blocks = torch.nn.ModuleList(
        TransformerLayer(
            cfg,
            layer_number=i,
            groups=groups,
            moe_factory=default_moe_factory,
            settings=LayerSettings(params_dtype=torch.bfloat16, device="cuda"),
        )
        for i in range(a.layers)
    )
    pos = torch.arange(a.seq, device="cuda")
    cos, sin = rope_cos_sin(pos, cfg.kv_channels, cfg.rope_theta)
    rope = (cos, sin, None, (0,))
    x = torch.randn(a.seq, 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        y = x
        with fp8_region(fp8_recipe, amax_reduction_group=None):  # one region per forward, as a model chunk
            for b in blocks:
                y = b(y, rope)
        y.float().sum().backward()

    f = flops_per_token(cfg, a.seq)
    per_tok = 3 * (f.forward - f.output_layer)
    return _time(step, a.iters), per_tok * a.seq


def main(argv=None):
    """Run the GPU cases; print the table last and write the report."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description="GPU MFU of Mixtral-8x7B-shaped layers")
    p.add_argument("--mode", default="gpu")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--fp8-recipe", default="blockwise")
    p.add_argument("--out", default=None)
    a, _ = p.parse_known_args(argv)
    if not torch.cuda.is_available():
        print("GPU mode needs a CUDA device; none is visible here (nothing measured).")
        return 2
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    torch.cuda.set_device(0)
    rows = ["| case | dtype | ms | TFLOP/s | measured peak TFLOP/s | MFU |", "|---|---|---|---|---|---|"]
    notes = []
    for dtype, recipe in (("bf16", None), ("fp8", a.fp8_recipe)):
        peak, why = matmul_peak(dtype)
        if peak is None:
            notes.append(f"- {dtype}: skipped: {why}")
            continue
        rows.append(f"| dense matmul 8192^3 | {dtype} | - | {peak / 1e12:.0f} | {peak / 1e12:.0f} | 100% |")
        for name, case in (
            ("MoE layer (8x7B, %d tokens)" % a.tokens, moe_layer_case),
            ("%d full layers (8x7B, seq %d)" % (a.layers, a.seq), layers_case),
        ):
            try:
                sec, flops = case(a, recipe)
            except Exception as e:  # noqa: BLE001 - e.g. TransformerEngine missing for FP8: say so
                notes.append(f"- {name} {dtype}: skipped: {type(e).__name__}: {e}")
                continue
            rows.append(
                f"| {name} | {dtype} | {sec * 1e3:.1f} | {flops / sec / 1e12:.0f} | {peak / 1e12:.0f} | "
                f"{100 * flops / sec / peak:.1f}% |"
            )
    text = "\n".join(
        [
            "# GPU MFU: Mixtral-8x7B-shaped layers on one GPU",
            "",
            f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}",
            f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            f"- command: `python -m benchmarks.bench_train {' '.join(argv)}`",
            "- MFU = model FLOPs (3 x forward) / time / measured dense-matmul peak of the same dtype",
            "",
            *rows,
            "",
            *notes,
            "",
        ]
    )
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0
