"""Activation memory, measured against the memory model: every term of one layer of every family, in bf16 and
fp32, every recompute module's saving, the last stage, and the MoE block against Megatron-Core's.

What a layer keeps for backward is measured by :class:`folding.testing.kept_memory.KeptCensus` (every storage
its forward creates and leaves alive, by the module that made it; one process, CPU) and compared with
:func:`folding.planning.activations.activation_terms` term by term (``device="cpu"``: the only difference from
the GPU model is MLA's values, which PyTorch's CPU flash kernel takes zero-padded to the query width). Shape: the
presets' architectures at hidden 256, 8 experts, top-2, expert FFN 128, a micro-batch of one 512-token sequence
(DeepSeek-V3: its tiny preset's MLA and its dense first layer at hidden 256).

- Terms: per family, dtype and term, model and measured bytes per token and their ratio.
- Recompute modules: per module (on a family where it applies), the bytes per token it saves, model and
  measured, in bf16 and fp32.
- FP8 experts: Mixtral's layer in bf16 with ``moe.fp8_recipe`` on the ``emulated`` backend, each recipe with
  and without ``moe.fp8_act_input_store``: the dispatch and experts terms (each GEMM's input kept as FP8
  codes and scales) and the total.
- Last stage: the whole model forward with the loss (one layer, final norm, fused loss; DeepSeek-V3 also its
  MTP module) against the sum of the model's terms.
- Offload modules: per module, the bytes per token it frees on the device and those its host tier takes
  (on CPU a separate storage, counted apart), model and measured.
- MoE block against Megatron-Core 0.16.1's ``MoELayer`` (SequentialMLP, fused weighted SwiGLU, fp32 router,
  the all-to-all dispatcher) at the same shape in bf16, measured the same way (one gloo rank; needs
  megatron-core, the ``dev`` extras).

Usage::

    python -m benchmarks.bench_activation_memory --out benchmarks/results/activation_memory_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from types import SimpleNamespace

import torch

from folding.model.presets import get_preset
from folding.model.transformer import MoETransformer
from folding.moe.settings import LayerSettings
from folding.planning.activations import (
    TERMS,
    activation_terms,
    logits_bytes,
    mtp_activation_bytes,
    offloaded_bytes_per_layer,
    rope_bytes,
)
from folding.testing import RankPool
from folding.testing.kept_memory import KeptCensus, bytes_by, layer_census, layer_term, loss_census

T = 512
ONE_RANK = SimpleNamespace(tp=1, cp=1, etp=1)
FAMILIES = ("mixtral_tiny", "qwen2_moe_tiny", "qwen3_moe_tiny", "olmoe_tiny", "deepseek_v3_tiny")
DTYPES = (torch.bfloat16, torch.float32)
MODULES = {  # recompute module -> (family, layer) where it applies
    "core_attn": ("qwen3_moe_tiny", "1"),
    "layernorm": ("mixtral_tiny", "1"),
    "moe_act": ("mixtral_tiny", "1"),
    "mla_up_proj": ("deepseek_v3_tiny", "1"),
    "mlp": ("deepseek_v3_tiny", "0"),
    "moe": ("qwen2_moe_tiny", "1"),
    "shared_experts": ("qwen2_moe_tiny", "1"),
    "full": ("mixtral_tiny", "1"),
}


FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8", "rowwise")


def config(family: str, moe=None):
    """The family's preset at the benchmark's shape (``moe``: MoE options over it)."""
    if family.startswith("deepseek"):
        base = {"ffn_hidden_size": 128, "shared_expert_ffn_hidden_size": 128, "aux_loss_coeff": 0.01}
    else:
        base = {"num_experts": 8, "topk": 2, "ffn_hidden_size": 128, "aux_loss_coeff": 0.01}
    return get_preset(family, num_layers=2, hidden_size=256, moe={**base, **(moe or {})})


def measure(family: str, layer_name: str, dtype, recompute: str = "none", moe=None, offload: str = ""):
    """``(model terms, measured terms, is MoE)`` of one layer, bytes on the device (the host tier's bytes
    under the key ``"host"`` of both, with ``offload``)."""
    cfg = config(family, moe)
    settings = LayerSettings(init_seed=1, params_dtype=dtype, recompute=recompute, offload_modules=offload)
    model = MoETransformer(cfg, settings=settings)
    layer = model.layers[layer_name]
    x0 = torch.randn(T, 1, cfg.hidden_size, dtype=dtype, generator=torch.Generator().manual_seed(0))
    kept, _, _ = layer_census(layer, x0, model.rope(T, dtype=dtype), offloader=model.offloader)
    measured = bytes_by([k for k in kept if k.tier == "device"], lambda k: layer_term(k.module, layer.is_moe))
    kw = dict(seq_length=T, micro_batch_size=1, act_bytes=dtype.itemsize, device="cpu", recompute=recompute)
    model_terms = activation_terms(cfg, ONE_RANK, moe_layer=layer.is_moe, offload=offload, **kw)
    if offload:
        measured["host"] = sum(k.nbytes for k in kept if k.tier == "host")
        model_terms["host"] = offloaded_bytes_per_layer(cfg, ONE_RANK, moe_layer=layer.is_moe, offload=offload, **kw)
    return model_terms, measured, layer.is_moe


OFFLOADS = {  # offload modules -> (family, layer) where they move something off the device
    "attn_norm": ("mixtral_tiny", "1"),
    "qkv_linear": ("qwen3_moe_tiny", "1"),
    "core_attn": ("qwen3_moe_tiny", "1"),
    "core_attn,attn_proj": ("olmoe_tiny", "1"),
    "attn_proj": ("deepseek_v3_tiny", "1"),
    "mlp_norm": ("qwen2_moe_tiny", "1"),
    "expert_fc1": ("mixtral_tiny", "1"),
    "moe_act": ("deepseek_v3_tiny", "1"),
}


def _offload_rows() -> list:
    """The offload section: per offload module, the device bytes it frees and the host bytes it takes."""
    lines = ["", "## Offload modules: bytes per token off the device and in the host tier (bf16)", ""]
    lines += ["| modules | family (layer) | freed: model | freed: measured | host: model | host: measured |"]
    lines += ["|---|---|---|---|---|---|"]
    for offload, (family, name) in OFFLOADS.items():
        m0, g0, _ = measure(family, name, torch.bfloat16)
        m1, g1, _ = measure(family, name, torch.bfloat16, offload=offload)
        hm, hg = m1.pop("host"), g1.pop("host")
        fm, fg = sum(m0.values()) - sum(m1.values()), sum(g0.values()) - sum(g1.values())
        print(f"offload {offload} {family}: freed {fm / T:.1f} / {fg / T:.1f}, host {hm / T:.1f} / {hg / T:.1f}")
        lines.append(f"| {offload} | {family} ({name}) | {fm / T:.1f} | {fg / T:.1f} | {hm / T:.1f} | {hg / T:.1f} |")
    return lines


def last_stage(family: str, dtype=torch.bfloat16):
    """``(model, measured)`` bytes of the whole forward with its loss of a one-layer model of ``family``."""
    cfg = config(family).replace(num_layers=1)
    model = MoETransformer(cfg, settings=LayerSettings(init_seed=1, params_dtype=dtype))
    measured = loss_census(model, T)
    a = dtype.itemsize
    kw = dict(seq_length=T, micro_batch_size=1, act_bytes=a)
    layer = sum(activation_terms(cfg, ONE_RANK, moe_layer=cfg.is_moe_layer(0), device="cpu", **kw).values())
    # one chunk of logits (T <= the loss's chunk): its softmax is kept, half of the model's peak figure
    head = logits_bytes(cfg, ONE_RANK, chunk_tokens=T, **kw) - 4 * T * cfg.vocab_size
    mtp = mtp_activation_bytes(cfg, ONE_RANK, device="cpu", **kw)
    want = layer + head + mtp + rope_bytes(cfg, ONE_RANK, seq_length=T, act_bytes=a) + 8 * T  # + embedding ids
    return want, measured


def _megatron_block():
    from tests.megatron_cpu import megatron_moe_kept

    return sum(k.nbytes for k in megatron_moe_kept(hidden=256, experts=8, topk=2, ffn=128, tokens=T))


def moe_blocks():
    """``(folding's MoE block, Megatron-Core's MoELayer)`` bytes per token, bf16 (Megatron's ``None`` without
    megatron-core)."""
    cfg = config("mixtral_tiny")
    model = MoETransformer(cfg, settings=LayerSettings(init_seed=1, params_dtype=torch.bfloat16))
    block = model.layers["1"].mlp
    x0 = torch.randn(T, 1, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    with KeptCensus(block) as census:
        x = census.make(lambda: x0.clone().requires_grad_())
        y = block(x)
    ours = sum(k.nbytes for k in census.kept(y)) / T
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return ours, None
    pool = RankPool(1)
    try:
        theirs = pool.run(_megatron_block)[0] / T
    finally:
        pool.shutdown()
    return ours, theirs


def _fp8_rows() -> list:
    """The FP8 section: Mixtral's layer, bf16, ``emulated`` experts, each recipe with and without the
    activation's input in FP8."""
    lines = ["", "## FP8 experts (`moe.fp8_recipe`, emulated backend), bf16: bytes per token kept", ""]
    lines += ["| recipe | fp8_act_input_store | dispatch | experts | total | ratio |", "|---|---|---|---|---|---|"]
    rows = [(None, False)] + [(r, s) for r in FP8_RECIPES for s in (False, True)]
    for recipe, store in rows:
        moe = {"expert_backend": "emulated", "fp8_recipe": recipe, "fp8_act_input_store": store} if recipe else {}
        model, measured, _ = measure("mixtral_tiny", "1", torch.bfloat16, moe=moe)
        cells = [f"{model[t] / T:.1f} / {measured.get(t, 0) / T:.1f}" for t in ("dispatch", "experts")]
        tm, tg = sum(model.values()), sum(measured.values())
        print(f"fp8 {recipe} store={store}: " + ", ".join(cells) + f", total {tm / T:.1f} / {tg / T:.1f}")
        lines.append(
            f"| {recipe or 'none (bf16)'} | {str(store).lower()} | "
            + " | ".join(cells)
            + f" | {tm / T:.1f} / {tg / T:.1f} | {_ratio(tm, tg)} |"
        )
    return lines + ["", "Cells: model / measured bytes per token."]


def _ratio(model: float, measured: float) -> str:
    return f"{model / measured:.3f}" if measured else ("1" if not model else "-")


def report(args) -> str:
    lines = [
        "# Activation memory: the memory model against what the layers keep (CPU)",
        "",
        f"Written by `python -m benchmarks.bench_activation_memory --out {args.out}` on "
        f"{datetime.date.today()}, {platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}.",
        "Measured: every storage a layer's forward creates and leaves alive (`folding.testing.kept_memory`),",
        'by the module that made it; model: `folding.planning.activations.activation_terms` (`device="cpu"`).',
        f"Shape: hidden 256, 8 experts, top-2, expert FFN 128, {T} tokens (one sequence); bytes per token.",
        "",
    ]
    ours, theirs = moe_blocks()
    lines += ["## The MoE block against Megatron-Core (bf16)", "", "| block | bytes/token | ratio to Megatron-Core |"]
    lines += ["|---|---|---|"]
    if theirs:
        lines.append(f"| Megatron-Core 0.16.1 `MoELayer` | {theirs:.1f} | 1.000 |")
    lines.append(f"| folding `MoELayer` | {ours:.1f} | {f'{ours / theirs:.3f}' if theirs else '-'} |")
    lines += ["", "## Every term of one layer", ""]
    lines += ["| family | layer | dtype | " + " | ".join(TERMS) + " | total | max term error |"]
    lines += ["|" + "---|" * (len(TERMS) + 5)]
    for family in FAMILIES:
        for name in ("0", "1") if family.startswith("deepseek") else ("1",):
            for dtype in DTYPES:
                model, measured, moe = measure(family, name, dtype)
                cells, worst = [], 0.0
                for t in TERMS:
                    m, g = model[t], measured.get(t, 0)
                    cells.append(f"{m / T:.0f} / {g / T:.0f}" if m or g else "-")
                    if g:
                        worst = max(worst, abs(m - g) / g)
                    print(f"{family} L{name} {dtype} {t}: model {m / T:.1f} measured {g / T:.1f}")
                tm, tg = sum(model.values()), sum(measured.values())
                kind = "MoE" if moe else "dense"
                lines.append(
                    f"| {family} | {name} ({kind}) | {str(dtype)[6:]} | "
                    + " | ".join(cells)
                    + f" | {tm / T:.1f} / {tg / T:.1f} ({_ratio(tm, tg)}) | {100 * worst:.1f}% |"
                )
    lines += ["", "Cells: model / measured bytes per token.", "", "## Recompute modules: bytes per token saved", ""]
    lines += ["| module | family (layer) | dtype | model | measured | ratio |", "|---|---|---|---|---|---|"]
    for module, (family, name) in MODULES.items():
        for dtype in DTYPES:
            m0, g0, _ = measure(family, name, dtype)
            m1, g1, _ = measure(family, name, dtype, module)
            sm, sg = sum(m0.values()) - sum(m1.values()), sum(g0.values()) - sum(g1.values())
            print(f"{module} {family} {dtype}: saves model {sm / T:.1f} measured {sg / T:.1f}")
            lines.append(
                f"| {module} | {family} ({name}) | {str(dtype)[6:]} | {sm / T:.1f} | {sg / T:.1f} | {_ratio(sm, sg)} |"
            )
    lines += _fp8_rows()
    lines += _offload_rows()
    lines += ["", "## The last stage: layer, final norm, fused loss (and MTP), bf16", ""]
    lines += ["| family | model | measured | ratio |", "|---|---|---|---|"]
    for family in ("mixtral_tiny", "deepseek_v3_tiny"):
        want, got = last_stage(family)
        lines.append(f"| {family} | {want / T:.1f} | {got / T:.1f} | {_ratio(want, got)} |")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    """Measure, print, and write the markdown report to ``--out``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/activation_memory_cpu.md", help="markdown report path")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    text = report(args)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
