"""Muon's arithmetic: Newton–Schulz orthogonalization and the update of one stack of matrices.

Muon (Keller Jordan; the Moonlight recipe for large models) updates a 2-D weight ``W [M, N]`` with
the orthogonalized momentum of its gradient:

1. ``m = μ·m + g`` (momentum buffer, ``optim.muon_momentum``);
2. ``u = g + μ·m`` with ``optim.muon_nesterov``, else ``u = m``;
3. ``O = NS5(u)``: ``optim.muon_ns_steps`` quintic Newton–Schulz iterations in fp32 on the *full*
   matrix, which drive every singular value of ``u / ‖u‖_F`` towards 1 (:func:`newton_schulz5`);
4. ``update = O · optim.muon_update_scale · sqrt(max(M, N))`` (:func:`update_scale`: Moonlight's
   factor that gives the update the RMS of an AdamW update, so AdamW's LR and weight decay carry over);
5. ``W ← W − lr·wd·W − lr·update`` (decoupled weight decay, then the step).

Everything here works on a stack ``[K, M, N]`` of independent matrices (the experts of one weight,
or the gate and up halves of a fused SwiGLU fc1) and knows nothing of process groups; the gathering
of tensor-parallel pieces and the ownership under ZeRO-1 are :mod:`folding.optim.muon_owner`.

Usage::

    chunks = stack_chunks(K, M * N)                                       # bounded Newton–Schulz stacks
    u = momentum_direction(g_KMN, m_KMN, momentum=0.95, nesterov=True)   # updates m in place
    o = newton_schulz5(u, steps=5)                                        # fp32, same shape
    w32.mul_(1 - lr * wd).add_(o, alpha=-lr * update_scale(M, N, 0.2))
"""

from __future__ import annotations

import math
from typing import Optional

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""``(a, b, c)`` of the quintic ``X ← a·X + b·(X Xᵀ) X + c·(X Xᵀ)² X`` (Keller Jordan's tuned
coefficients: fast growth of small singular values, which then oscillate in about [0.7, 1.2])."""

NS_STACK_ELEMENTS = 1 << 25
"""The most full-matrix elements one Newton–Schulz call stacks (128 MiB of fp32): an owner's matrices
of one parameter go through in chunks of at most this many elements (at least one matrix each), so
the working set (about four fp32 copies of the stack, see ``muon_transient_bytes``) stays bounded
however many experts a rank owns, while small matrices still batch."""

NS_EPS = 1e-7
"""Added to the Frobenius norm before the first iteration (an all-zero matrix stays zero)."""


def newton_schulz5(x_KMN: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Approximately orthogonalize each matrix of ``x_KMN`` (``[..., M, N]``): ``steps`` quintic
    Newton–Schulz iterations (:data:`NS_COEFFICIENTS`) on ``x / (‖x‖_F + eps)``, in fp32, on the
    transposed matrix when ``M > N`` (so that ``X Xᵀ`` is the smaller Gram matrix). Returns fp32 of
    the input's shape: ``U·f(Σ)·Vᵀ`` for ``x = U Σ Vᵀ``, with ``f(σ)`` in about [0.7, 1.2] for the
    singular values that matter (a zero matrix stays zero)."""
    a, b, c = NS_COEFFICIENTS
    x = x_KMN.float()
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, ord="fro", dim=(-2, -1), keepdim=True) + NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return (x.mT if tall else x).contiguous()


def stack_chunks(count: int, matrix_elements: int, budget: Optional[int] = None):
    """``[(start, stop), ...]`` covering ``range(count)`` in order: consecutive matrices of
    ``matrix_elements`` each, at most ``budget`` (default :data:`NS_STACK_ELEMENTS`) elements per
    chunk and at least one matrix. Pure:
    tensor-parallel peers that own the same matrices chunk them the same way (their gathers pair up).

    Example: ``stack_chunks(5, 10, budget=25)`` -> ``[(0, 2), (2, 4), (4, 5)]``."""
    budget = NS_STACK_ELEMENTS if budget is None else budget
    per = max(1, budget // max(1, matrix_elements))
    return [(i, min(i + per, count)) for i in range(0, count, per)]


def momentum_direction(g_KMN: torch.Tensor, m_KMN: torch.Tensor, *, momentum: float, nesterov: bool) -> torch.Tensor:
    """Update the fp32 momentum buffer ``m ← μ·m + g`` in place and return the direction Muon
    orthogonalizes: ``g + μ·m`` (Nesterov) or ``m`` (a fresh tensor either way)."""
    g = g_KMN.float()
    m_KMN.mul_(momentum).add_(g)
    return g.add(m_KMN, alpha=momentum) if nesterov else m_KMN.clone()


def update_scale(rows: int, cols: int, scale: float) -> float:
    """The factor of the orthogonalized matrix in the update: ``scale · sqrt(max(rows, cols))`` for a
    full matrix ``[rows, cols]`` (Moonlight: with ``scale=0.2`` the update's RMS matches AdamW's)."""
    return scale * math.sqrt(max(rows, cols))


def apply_update(w32: torch.Tensor, update: torch.Tensor, *, lr: float, weight_decay: float) -> None:
    """``w ← w − lr·wd·w − lr·update`` in place on fp32 weights (decoupled weight decay first)."""
    if weight_decay:
        w32.mul_(1.0 - lr * weight_decay)
    w32.add_(update, alpha=-lr)
