"""The kernel floor of a training step: the work every model driven the common way must do.

Side by side, both models run the same matmuls (same shapes, same FLOPs), the same attention
kernels, the same ``torch.optim.AdamW`` over the same number of parameters and the same
cross-entropy of the shifted logits. Timed on their own, without a profiler, those pieces give a
lower bound on any such step; the transformers step divided by it bounds the speed-up that any
other model implementation can reach on this machine.

- ``gemm``: every ``aten::mm`` of one recorded step (``grouped_mm`` on CPU runs one per expert),
  replayed with the recorded sizes and strides (transposed operands stay transposed).
- ``attention``: ``scaled_dot_product_attention`` forward and backward (causal, GQA) per layer.
- ``optimizer``: ``AdamW.step()`` on the model's parameters with gradients present.
- ``loss``: cross-entropy of the shifted logits, forward and backward, from fixed logits.

Each piece is the best of ``reps`` timings (the least disturbed on a shared host).

Usage::

    from benchmarks.floor import kernel_floor
    parts = kernel_floor(hf_model, step_fn, a)     # {"gemm": s, "attention": s, "optimizer": s, "loss": s}
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from benchmarks.memory_probe import event_nodes


def _mm_operands(step) -> list:
    """``[((sizes, strides), (sizes, strides)), ...]`` of every ``aten::mm`` in one call of ``step``."""
    with torch.profiler.profile(record_shapes=True) as prof:
        step()
    found = []
    for node, _ in event_nodes(prof):
        if node.name == "aten::mm":
            ins = [(tuple(t.sizes), tuple(t.strides)) for t in node.extra_fields.inputs if hasattr(t, "sizes")]
            if len(ins) >= 2:  # mm.out (inside grouped_mm) has a third
                found.append(tuple(ins[:2]))
    return found


def _strided(sizes, strides) -> torch.Tensor:
    """A random tensor with exactly these sizes and strides (stride 0 = a broadcast operand)."""
    span = 1 + sum((n - 1) * s for n, s in zip(sizes, strides) if n > 0)
    return torch.randn(span).as_strided(sizes, strides)


def _best(fn, reps: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_seconds(step, reps: int = 3) -> tuple[float, int]:
    """Seconds of the step's matmuls replayed back to back, and how many there are."""
    ops = [(_strided(*a), _strided(*b)) for a, b in _mm_operands(step)]

    def run():
        for x, w in ops:
            torch.mm(x, w)

    return _best(run, reps), len(ops)


def attention_seconds(a, reps: int = 3) -> float:
    """Causal GQA attention forward + backward for every layer (``a``: the benchmark's arguments)."""
    d = a.hidden // a.heads
    q = torch.randn(a.batch, a.heads, a.seq, d, requires_grad=True)
    k = torch.randn(a.batch, a.kv_heads, a.seq, d, requires_grad=True)
    v = torch.randn(a.batch, a.kv_heads, a.seq, d, requires_grad=True)
    g = torch.randn(a.batch, a.heads, a.seq, d)

    def run():
        for _ in range(a.layers):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=a.kv_heads != a.heads)
            out.backward(g)

    return _best(run, reps)


def optimizer_seconds(model, reps: int = 3) -> float:
    """``AdamW.step()`` over a copy of the model's parameters with random gradients."""
    params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-5)
    return _best(opt.step, reps)


def loss_seconds(a, reps: int = 3) -> float:
    """Cross-entropy of the shifted logits, forward and backward (the common driver's loss)."""
    logits = torch.randn(a.batch, a.seq, a.vocab, requires_grad=True)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq))

    def run():
        F.cross_entropy(logits[:, :-1].reshape(-1, a.vocab).float(), ids[:, 1:].reshape(-1)).backward()

    return _best(run, reps)


def kernel_floor(model, step, a, reps: int = 3) -> dict:
    """Seconds per piece of the floor (module docstring) for ``model`` driven by ``step``."""
    gemm, n_mm = gemm_seconds(step, reps)
    return {
        "gemm": gemm,
        "attention": attention_seconds(a, reps),
        "optimizer": optimizer_seconds(model, reps),
        "loss": loss_seconds(a, reps),
        "matmuls": n_mm,
    }
