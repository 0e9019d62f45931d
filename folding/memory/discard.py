"""Discard a tensor's storage after its consumers' forward; refill it just before their backward.

A consumer that saves its input for backward (a GEMM saving the normalized activations, fc2 saving the
experts' activation) keeps that input alive from forward to backward. When the producer's own backward
does not need the values (an RMSNorm keeps its input and ``rstd``; the fused SwiGLU keeps fc1's output;
a matmul, a concatenation and RoPE need their inputs, not their outputs), the storage can be freed once
every consumer has run forward, and written again from what the producer kept, by running the
producer's forward once more (without autograd), when backward reaches the consumers: the tensor
objects the consumers saved are the same, only their storage was empty in between. This is
Megatron-Core's recompute of the ``layernorm``, ``moe_act`` and ``mla_up_proj`` modules; unlike a
checkpoint it builds no second graph and runs no nested backward.

The refill runs in a hook on ``after`` (a tensor whose gradient backward computes before any consumer's
backward runs: the consumers' common output), so it comes after the gradient of ``after`` and before the
node that made it. The refilled values are the forward's own bitwise: the same ops on the same inputs.

Usage::

    n_SBH = norm(x_SBH)                                    # keeps x and rstd, not n
    a_SBH = attention(n_SBH)                               # saves n for its backward
    discard_until_backward([n_SBH], after=a_SBH, refill=lambda: [norm(x_SBH)])
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["discard_until_backward"]


def discard_until_backward(
    tensors: Sequence[torch.Tensor], *, after: torch.Tensor, refill: Callable[[], Sequence[torch.Tensor]]
) -> None:
    """Free the storages of ``tensors`` now and give them their values back when backward reaches
    ``after``: ``refill()`` (run without autograd) returns tensors of the same shapes, dtypes and
    layout, whose bytes are copied into the original storages.

    Does nothing without autograd (no backward will come) or when ``after`` does not require grad.
    ``tensors`` must not be read between now and then except by the backward of their consumers.
    """
    if not torch.is_grad_enabled() or not after.requires_grad:
        return
    storages = [t.untyped_storage() for t in tensors]
    sizes = [s.nbytes() for s in storages]

    def hook(grad):
        with torch.no_grad():
            fresh = refill()
            for s, n, f in zip(storages, sizes, fresh):
                fs = f.untyped_storage()
                if fs.nbytes() != n:
                    raise RuntimeError(f"discard_until_backward: the refill made {fs.nbytes()} bytes, not {n}")
                s.resize_(n)
                s.copy_(fs)
        return grad

    for s in storages:
        s.resize_(0)
    after.register_hook(hook)
