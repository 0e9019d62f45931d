"""The training step the benchmarks time, shared by ``bench_train`` (side by side) and ``train_layouts``.

The transformers config of the benchmark model, the two losses (the common driver and the engine's own
fused step), one AdamW step as a closure, profiler labels and breakdowns, model FLOPs per step and the
report header.
"""

from __future__ import annotations

import datetime
import os
import platform
import time

import torch
import torch.nn.functional as F

from benchmarks.breakdown import Labeller, breakdown, op_classes
from folding.model import fused_cross_entropy
from folding.model.attention import Attention
from folding.moe.experts.grouped import GroupedMLP
from folding.moe.layer import MoELayer
from folding.moe.routing.router import Router


def mixtral_config(a):
    """The transformers ``MixtralConfig`` of the benchmark (aux loss off, SDPA attention)."""
    from transformers import MixtralConfig

    return MixtralConfig(
        hidden_size=a.hidden,
        intermediate_size=a.ffn,
        num_local_experts=a.experts,
        num_experts_per_tok=a.topk,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        vocab_size=a.vocab,
        max_position_embeddings=max(4096, a.seq),
        output_router_logits=False,
        router_aux_loss_coef=0.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def hf_loss(model, ids):
    """The common driver: ``logits = model(ids)``, mean cross-entropy of the shifted logits."""
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    with torch.profiler.record_function("part:loss"):
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def engine_loss(model, ids):
    """The engine's own step: per-token losses from its fused vocab-parallel cross-entropy, mean."""
    labels = torch.roll(ids, -1, 1)
    mask = torch.ones_like(ids, dtype=torch.float32)
    mask[:, -1] = 0
    return model(ids, labels=labels, loss_mask=mask).sum() / mask.sum()


def label_engine(model) -> Labeller:
    """Profiler labels for the engine: attention, router, dispatch, experts, combine, fused loss."""
    lab = Labeller()
    lab.modules(model, {"attention": (Attention,), "router": (Router,), "experts": (GroupedMLP,)})
    for m in model.modules():
        if isinstance(m, MoELayer):
            lab.method(m.dispatcher, "dispatch", "dispatch")
            lab.method(m.dispatcher, "combine", "combine")
    ce = fused_cross_entropy._FusedLinearCE
    if not getattr(ce, "_labelled", False):
        fwd = ce.apply

        def apply(*a):
            with torch.profiler.record_function("part:loss"):
                return fwd(*a)

        ce.apply, ce._labelled = apply, True
    return lab


def label_hf(model) -> Labeller:
    """Profiler labels for transformers' Mixtral (its experts module does dispatch, experts and combine)."""
    from transformers.models.mixtral import modeling_mixtral as mm

    lab = Labeller()
    lab.modules(
        model, {"attention": (mm.MixtralAttention,), "router": (mm.MixtralTopKRouter,), "experts": (mm.MixtralExperts,)}
    )
    return lab


def make_step(model, loss_fn, ids):
    """One training step (forward, backward, AdamW) as a closure; returns the loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        loss = loss_fn(model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return step


def profile_step(step, n: int = 2):
    """``(parts, kinds)``: seconds per model part and per kind of work (GEMM, attention kernels,
    optimizer, rest) of a step under the PyTorch profiler, each the mean of ``n`` steps."""
    parts, kinds = {}, {}
    for _ in range(n):
        with torch.profiler.profile() as prof:
            t0 = time.perf_counter()
            step()
            wall = time.perf_counter() - t0
        for acc, fn in ((parts, breakdown), (kinds, op_classes)):
            for k, v in fn(prof, wall).items():
                acc[k] = acc.get(k, 0.0) + v / n
    return parts, kinds


def flops_per_step(a) -> float:
    """Model FLOPs of one training step (3x forward matmul FLOPs, causal attention halved)."""
    T = a.batch * a.seq
    kvd = a.hidden // a.heads * a.kv_heads
    per_tok = 2 * (a.hidden * (a.hidden + 2 * kvd) + a.hidden * a.hidden)  # q, k, v, o
    per_tok += 2 * a.hidden * a.experts + 2 * a.topk * 3 * a.hidden * a.ffn  # router, experts
    per_tok *= a.layers
    per_tok += 2 * a.hidden * a.vocab  # output layer
    attn = a.layers * 2 * 2 * a.seq * a.hidden / 2  # QK^T and PV, causal
    return 3 * T * (per_tok + attn)


def header(a, argv) -> str:
    """Device, versions, date, load and command."""
    import transformers

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return "\n".join(
        [
            f"- device: CPU ({platform.machine()}, {os.cpu_count()} cores visible), {a.threads} torch threads, fp32",
            f"- torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}",
            f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            f"- host load average at the end (1/5/15 min): {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
            f"on {os.cpu_count()} CPUs (shared machine: timings are noisy; medians of alternating runs)",
            f"- command: `python -m benchmarks.bench_train {' '.join(argv)}`",
            f"- model: Mixtral H={a.hidden} F={a.ffn} E={a.experts} top-{a.topk} layers={a.layers} heads={a.heads}/"
            f"{a.kv_heads} vocab={a.vocab}; batch {a.batch} x seq {a.seq}; AdamW; aux loss off",
        ]
    )
