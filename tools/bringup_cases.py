"""The measurements of the GPU bring-up (:mod:`tools.gpu_bringup`), one function per report section.

Each case returns markdown lines. Sizes come from a :class:`Sizes` record: the realistic ones on a GPU,
toy ones for the CPU smoke run (the same code path, so that CI keeps the script working).

- :func:`expert_numerics`: every expert backend × FP8 recipe this device supports, against an fp32
  ``loop`` reference of the same weights and inputs, and each FP8 recipe against its ``emulated``
  backend (the CPU oracle of that recipe's quantization).
- :func:`moe_layer_speed`: one MoE layer forward + backward per (experts, top-k) shape, BF16 and the
  FP8 recipe of the ``torch`` backend, beside transformers' Mixtral sparse MoE block on the same shape.
- :func:`training_run`: the real training job (the entry point's composed config and ``run_job``) for a
  few steps, read back from its ``metrics.jsonl``, with the host synchronizations CUDA reports
  (``torch.cuda.set_sync_debug_mode("warn")``) counted by call site.

Usage: ``python -m tools.gpu_bringup`` (see there).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
import warnings

import torch
import torch.distributed as dist

from folding.job.compose import compose_tree
from folding.job.schema import register_schema
from folding.launch.run import run_job
from folding.model.presets import get_preset
from folding.moe.experts.grouped import GroupedMLP
from folding.moe.experts.select import backend_support
from folding.moe.experts.te import fp8_region
from folding.moe.layer import build_moe_layer
from folding.moe.settings import LayerSettings
from folding.parallel.groups import ProcessGroups
from folding.quant.emulate import RECIPES

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Shapes of every case (``gpu()`` realistic, ``cpu_smoke()`` toy)."""

    numerics_hidden: int
    """H of the expert-numerics case."""
    numerics_ffn: int
    """F of the expert-numerics case."""
    numerics_counts: tuple
    """Rows per local expert in the numerics case (one expert with none)."""
    layer_hidden: int
    """H of the MoE-layer speed cases."""
    layer_tokens: int
    """Tokens per MoE-layer call."""
    layer_shapes: tuple
    """``(experts, top_k, ffn)`` per speed case."""
    iters: int
    """Timed repetitions per speed case (median reported)."""
    train_overrides: tuple
    """Overrides of the training run (entry-point syntax)."""


def gpu_sizes() -> Sizes:
    """H 4096, E 8 and 64, top-2 and top-8, 8192 tokens; 20 training steps of 2 Mixtral-8x7B layers at seq 4096."""
    return Sizes(
        numerics_hidden=1024,
        numerics_ffn=2048,
        numerics_counts=(1024, 0, 512, 768),
        layer_hidden=4096,
        layer_tokens=8192,
        layer_shapes=((8, 2, 14336), (8, 8, 14336), (64, 2, 1792), (64, 8, 1792)),
        iters=5,
        train_overrides=(
            "model=mixtral_8x7b",
            "model.num_layers=2",
            "train.steps=20",
            "train.seq_length=4096",
            "train.micro_batch_size=1",
            "train.global_batch_size=4",
            "train.precision=bf16",
            "train.eval_interval=0",
            "logging.interval=1",
            "logging.wandb.mode=disabled",
        ),
    )


def cpu_sizes() -> Sizes:
    """Toy shapes for the CPU smoke run (seconds, fp32 where bf16 would be slow)."""
    return Sizes(
        numerics_hidden=64,
        numerics_ffn=128,
        numerics_counts=(37, 0, 64, 19),
        layer_hidden=64,
        layer_tokens=128,
        layer_shapes=((8, 2, 128), (16, 4, 64)),
        iters=2,
        train_overrides=(
            "train.steps=3",
            "train.global_batch_size=4",
            "train.eval_interval=0",
            "logging.interval=1",
            "logging.wandb.mode=disabled",
        ),
    )


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_median(fn, dev: torch.device, iters: int) -> float:
    """Median wall seconds of ``fn()`` over ``iters`` device-synchronized runs, after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _experts_run(mod, x, counts, probs, dy):
    x = x.detach().clone().requires_grad_()
    mod.zero_grad(set_to_none=True)
    y = mod(x, list(counts), probs)
    y.backward(dy.to(y.dtype))
    return [y, x.grad, mod.fc1_weight.grad, mod.fc2_weight.grad]


def expert_combos(dev: torch.device, dtype: torch.dtype):
    """``(backend, recipe, ok, why)`` for every backend × (no recipe, each FP8 recipe)."""
    rows = []
    for backend in ("loop", "torch", "te", "emulated"):
        for recipe in (None,) + tuple(RECIPES):
            ok, why = backend_support(backend, recipe, dev, dtype)
            rows.append((backend, recipe, ok, why))
    return rows


def expert_numerics(dev: torch.device, sizes: Sizes, dtype: torch.dtype) -> list[str]:
    """Relative errors of y, dx, dfc1, dfc2 per supported backend × recipe (module docstring)."""
    counts, H, F = sizes.numerics_counts, sizes.numerics_hidden, sizes.numerics_ffn
    g = torch.Generator().manual_seed(0)
    n = sum(counts)
    x = torch.randn(n, H, generator=g).to(dev)
    probs = torch.rand(n, generator=g).to(dev)
    dy = torch.randn(n, H, generator=g).to(dev)
    kw = dict(num_local_experts=len(counts), hidden_size=H, ffn_hidden_size=F, init_seed=7, device=dev)
    ref_mod = GroupedMLP(backend="loop", params_dtype=torch.float32, **kw)
    ref = _experts_run(ref_mod, x, counts, probs, dy)
    results, lines = {}, []
    lines += [
        f"Local experts with rows {list(counts)}, H {H}, F {F}, {dtype} weights and inputs; relative Frobenius "
        "error of the output y and the gradients dx, d(fc1), d(fc2) against the fp32 `loop` reference "
        "of the same weights; FP8 recipes also against their `emulated` backend (`vs emulated`).",
        "",
        "| backend | recipe | y | dx | d(fc1) | d(fc2) | vs emulated (y, dx, d(fc1), d(fc2)) |",
        "|---|---|---|---|---|---|---|",
    ]
    skipped = []
    for backend, recipe, ok, why in expert_combos(dev, dtype):
        if not ok:
            skipped.append(f"- {backend} / {recipe or 'none'}: not run: {why}")
            continue
        mod = GroupedMLP(backend=backend, fp8_recipe=recipe, params_dtype=dtype, **kw)
        with torch.no_grad():
            mod.fc1_weight.copy_(ref_mod.fc1_weight.to(dtype))
            mod.fc2_weight.copy_(ref_mod.fc2_weight.to(dtype))
        region = fp8_region(recipe, amax_reduction_group=None, first_microbatch=True) if backend == "te" else None
        if region is not None:
            with region:
                out = _experts_run(mod, x.to(dtype), counts, probs, dy)
        else:
            out = _experts_run(mod, x.to(dtype), counts, probs, dy)
        results[(backend, recipe)] = out
        errs = " | ".join(f"{_rel(a, r):.2e}" for a, r in zip(out, ref))
        lines.append(f"| {backend} | {recipe or 'none'} | {errs} | |")
    for (backend, recipe), out in results.items():
        emu = results.get(("emulated", recipe))
        if recipe is not None and backend != "emulated" and emu is not None:
            vs = ", ".join(f"{_rel(a, e):.2e}" for a, e in zip(out, emu))
            lines.append(f"| {backend} | {recipe} | | | | | {vs} |")
    return lines + [""] + skipped


def _layer(dev, dtype, H, E, k, F, recipe, backend):
    w = dist.group.WORLD
    cfg = get_preset("mixtral_8x7b").moe.replace(
        num_experts=E, topk=k, ffn_hidden_size=F, aux_loss_coeff=0.0, fp8_recipe=recipe, expert_backend=backend
    )
    groups = ProcessGroups(tp=w, tp_cp=w, tp_dp_cp=w, ep=w, etp=w)
    return build_moe_layer(
        config=cfg, hidden_size=H, groups=groups, settings=LayerSettings(params_dtype=dtype, device=dev)
    )


def _hf_block(dev, dtype, H, E, k, F):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=H, intermediate_size=F, num_local_experts=E, num_experts_per_tok=k)
    return MixtralSparseMoeBlock(cfg).to(device=dev, dtype=dtype)


def _time_layer(module, shape, dev, dtype, iters) -> float:
    """Median forward + backward seconds of ``module`` on one random input of ``shape``."""
    x = torch.randn(*shape, device=dev, dtype=dtype, requires_grad=True)

    def step():
        out = module(x)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()

    return time_median(step, dev, iters)


def moe_layer_speed(dev: torch.device, sizes: Sizes, dtype: torch.dtype, fp8_recipe: str) -> list[str]:
    """Forward + backward ms and TFLOP/s of one MoE layer per shape: BF16, FP8 ``fp8_recipe`` (torch
    backend), and transformers' ``MixtralSparseMoeBlock`` (BF16)."""
    T, H = sizes.layer_tokens, sizes.layer_hidden
    lines = [
        f"{T} tokens, H {H}, forward + backward of one MoE layer (router, dispatch, experts, combine), "
        f"median of {sizes.iters}; TFLOP/s counts the model FLOPs 3 x (2·k·3·H·F + 2·H·E) per token.",
        "",
        "| experts | top-k | F | implementation | ms | TFLOP/s |",
        "|---|---|---|---|---|---|",
    ]
    notes = []
    for E, k, F in sizes.layer_shapes:
        flops = 3 * T * (2 * k * 3 * H * F + 2 * H * E)
        plain = str(dtype).replace("torch.", "")
        cases = [
            (f"folding {plain} (auto backend)", None, "auto"),
            (f"folding {fp8_recipe} (torch)", fp8_recipe, "torch"),
        ]
        for name, recipe, backend in cases:
            try:
                ok, why = (True, "") if recipe is None else backend_support(backend, recipe, dev, dtype)
            except ValueError as e:  # a recipe this version does not know
                ok, why = False, str(e)
            if not ok:
                notes.append(f"- E{E} k{k} {name}: not run: {why}")
                continue
            sec = _time_layer(_layer(dev, dtype, H, E, k, F, recipe, backend), (T, 1, H), dev, dtype, sizes.iters)
            lines.append(f"| {E} | {k} | {F} | {name} | {sec * 1e3:.2f} | {flops / sec / 1e12:.1f} |")
        try:
            blk = _hf_block(dev, dtype, H, E, k, F)
        except Exception as e:  # noqa: BLE001 - transformers missing or its API changed: say so
            notes.append(f"- E{E} k{k} transformers MixtralSparseMoeBlock: not run: {type(e).__name__}: {e}")
            continue
        sec = _time_layer(blk, (1, T, H), dev, dtype, sizes.iters)
        hf = f"transformers MixtralSparseMoeBlock {plain}"
        lines.append(f"| {E} | {k} | {F} | {hf} | {sec * 1e3:.2f} | {flops / sec / 1e12:.1f} |")
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return lines + [""] + notes


def _count_syncs(caught) -> collections.Counter:
    by_site = collections.Counter()
    root = os.path.abspath(os.path.join(CONFIGS, ".."))
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            path = os.path.relpath(os.path.abspath(w.filename), root)
            by_site[f"{path}:{w.lineno}"] += 1
    return by_site


def training_run(dev: torch.device, sizes: Sizes, run_dir: str) -> list[str]:
    """The training job for a few steps; tokens/s, MFU, peak memory per step and the host syncs."""
    overrides = list(sizes.train_overrides)
    register_schema()
    tree = compose_tree(overrides, config_dir=CONFIGS, config_name="config")
    tree.pop("hydra", None)
    os.makedirs(run_dir, exist_ok=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            torch.cuda.set_sync_debug_mode("warn")
        t0 = time.perf_counter()
        try:
            status = run_job(tree, run_dir=run_dir, overrides=overrides)
        finally:
            if dev.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        wall = time.perf_counter() - t0
    rows = []
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind", "train") == "train" and "lm_loss" in rec:
                rows.append(rec)
    lines = [
        f"`{' '.join(overrides)}` on this one device: exit status {status}, {len(rows)} logged steps, "
        f"{wall:.0f} s in all (model build and data included).",
        "",
        "| step | lm_loss | step s | tokens/s | MFU | peak GiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        mfu = r.get("mfu")
        lines.append(
            f"| {r.get('step')} | {r.get('lm_loss', float('nan')):.4f} | {r.get('step_time_s', float('nan')):.3f} | "
            f"{r.get('tokens_per_s', float('nan')):.0f} | {'-' if mfu is None else f'{100 * mfu:.1f}%'} | "
            f"{r.get('mem_gib', float('nan')):.1f} |"
        )
    if dev.type != "cuda":
        return lines + ["", "Host synchronizations: counted by CUDA only on a GPU (not measured on CPU)."]
    syncs = _count_syncs(caught)
    steps = max(1, len(rows))
    lines += [
        "",
        f"Host synchronizations reported by CUDA (`torch.cuda.set_sync_debug_mode('warn')`) over the whole "
        f"run, set-up included: {sum(syncs.values())} ({sum(syncs.values()) / steps:.1f} per step at most); "
        "by call site, most frequent first:",
        "",
        "| call site | count |",
        "|---|---|",
    ]
    lines += [f"| {site} | {n} |" for site, n in syncs.most_common(25)]
    return lines
