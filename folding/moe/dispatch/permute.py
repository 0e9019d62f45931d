"""Token movement as pure functions: permute by routing map, unpermute, capacity, chunk sorting, splits.

Nothing here touches a process group; the dispatchers compose these functions with collectives, and
each one is unit-tested with small hand-worked cases.

Shape suffixes (docs/shapes.md): ``T`` local tokens, ``H`` hidden size, ``E`` global experts, ``L``
local experts (``E / EP``), ``N`` permuted rows (one per kept (token, expert) pair), ``R`` ranks, ``C``
chunks, ``Tc`` tokens of one chunk.

Ordering conventions:

- :func:`permute` is *expert-major*: all rows of expert 0 (in token order), then expert 1, ... This
  puts the rows bound for one EP rank next to each other, since EP rank ``d`` owns experts
  ``[d*L, (d+1)*L)``.
- After the EP all-to-all and the ETP all-gather, rows arrive *rank-major*: for every ETP rank ``j``,
  for every EP source rank ``s``, the chunk of each local expert ``l``. :func:`plan_alltoall` gives the
  chunk sizes and the chunk order that makes them expert-major again (``l``, then ``j``, then ``s``).

Usage::

    rows_NH, probs_N, token_idx_N = permute(tokens_TH, routing_map_TE, probs_TE, num_out_tokens=T * k)
    out_TH = unpermute(rows_NH, token_idx_N, num_tokens=T)          # unweighted sum per token
    plan = plan_alltoall(counts, ep_size=4, etp_size=2, ep_rank=1, etp_rank=0, num_local_experts=2)
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch

from ..routing.functions import expert_capacity
from . import host_sync


def padded_rows_per_expert(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Rows every expert receives under pad-to-capacity: ``min(capacity, T)``.

    When the capacity exceeds ``T`` nothing is dropped and every token is sent to every expert, the
    ones it was not routed to with probability 0 (Megatron-Core's behaviour).
    """
    cap = expert_capacity(num_tokens, topk=topk, num_experts=num_experts, capacity_factor=capacity_factor)
    return min(cap, num_tokens)


def permute(
    tokens_TH: torch.Tensor,
    routing_map_TE: torch.Tensor,
    probs_TE: Optional[torch.Tensor] = None,
    *,
    num_out_tokens: Optional[int] = None,
    rows_per_expert: Optional[int] = None,
    num_chunks: int = 1,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Gather one row per routed (token, expert) pair, expert-major.

    Args:
        tokens_TH: ``[T, H]`` token rows.
        routing_map_TE: ``[T, E]`` bool, True where the token goes to the expert.
        probs_TE: optional ``[T, E]`` router probabilities; the kept pairs' values travel with the rows.
        num_out_tokens: number of True entries when known statically (``T*k`` when dropless); makes
            the call free of device-to-host syncs. If neither this nor ``rows_per_expert`` is given,
            the count is read once through :func:`host_sync.to_host`.
        rows_per_expert: pad-to-capacity mode: every expert gets exactly this many rows (``<= T``),
            its routed tokens first (in token order), then unrouted filler tokens with probability 0.
            Routed tokens beyond this many are not sent, so the map must come from capacity-limited
            routing.
        num_chunks: pad-to-capacity only: the ``T`` rows are ``num_chunks`` equal chunks (tokens
            gathered from several ranks) and every expert takes ``rows_per_expert`` rows from *each*
            chunk; the output is expert-major, then chunk-major.

    Returns:
        ``(rows_NH, probs_N or None, token_idx_N)`` where ``token_idx_N[n]`` is the source token of
        row ``n`` (pass it to :func:`unpermute`).
    """
    T, E = routing_map_TE.shape
    if tokens_TH.shape[0] != T:
        raise ValueError(f"permute: tokens have {tokens_TH.shape[0]} rows but routing_map has {T}")
    if probs_TE is not None and probs_TE.shape != routing_map_TE.shape:
        raise ValueError(f"permute: probs shape {tuple(probs_TE.shape)} != routing_map shape {(T, E)}")
    if rows_per_expert is not None:
        if T % num_chunks:
            raise ValueError(f"permute: {T} rows do not split into num_chunks={num_chunks} equal chunks")
        Tc = T // num_chunks
        if not 0 <= rows_per_expert <= Tc:
            raise ValueError(f"permute: rows_per_expert={rows_per_expert} must be in [0, {Tc}] (tokens per chunk)")
        # A stable descending sort of each (expert, chunk) column puts its routed tokens first, in order.
        map_ECTc = routing_map_TE.T.reshape(E, num_chunks, Tc).to(torch.int8)
        order_ECTc = torch.argsort(map_ECTc, dim=2, descending=True, stable=True)[:, :, :rows_per_expert]
        offsets_C1 = (torch.arange(num_chunks, device=tokens_TH.device) * Tc).unsqueeze(1)
        token_idx_N = (order_ECTc + offsets_C1).reshape(-1)
        expert_idx_N = torch.arange(E, device=tokens_TH.device).repeat_interleave(num_chunks * rows_per_expert)
    else:
        if num_out_tokens is None:
            num_out_tokens = int(host_sync.to_host(routing_map_TE.sum(), reason="permute num_out_tokens"))
        flat_pos_N = torch.nonzero_static(routing_map_TE.T.reshape(-1), size=num_out_tokens).squeeze(1)
        token_idx_N = flat_pos_N % T
        expert_idx_N = flat_pos_N // T
    rows_NH = tokens_TH.index_select(0, token_idx_N)
    probs_N = None
    if probs_TE is not None:
        probs_N = probs_TE[token_idx_N, expert_idx_N]
        if rows_per_expert is not None:  # filler rows carry probability 0 whatever probs_TE holds
            probs_N = probs_N * routing_map_TE[token_idx_N, expert_idx_N].to(probs_N.dtype)
    return rows_NH, probs_N, token_idx_N


def unpermute(
    rows_NH: torch.Tensor, token_idx_N: torch.Tensor, *, num_tokens: int, probs_N: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Sum rows back into their source tokens: ``out[t] = Σ_{n: token_idx[n]=t} rows[n] (· probs[n])``.

    The dispatchers call it without ``probs_N`` (the experts already applied the probabilities); a
    token with no kept row gets zeros. Returns ``[num_tokens, H]`` in the dtype of ``rows_NH``.
    """
    if rows_NH.shape[0] != token_idx_N.shape[0]:
        raise ValueError(f"unpermute: {rows_NH.shape[0]} rows but {token_idx_N.shape[0]} indices")
    if probs_N is not None:
        rows_NH = rows_NH * probs_N.unsqueeze(1).to(rows_NH.dtype)
    return _SumRows.apply(rows_NH, token_idx_N, num_tokens)


class _SumRows(torch.autograd.Function):
    """Forward: ``out[t] = Σ_{n: idx[n]=t} rows[n]`` (``index_add_`` into a fresh zero buffer).
    Backward: ``grad_rows = grad_out[idx]``. Keeps the indices only (autograd's own ``index_add``
    would keep the ``[N, H]`` rows too, for their shape)."""

    @staticmethod
    def forward(ctx, rows_NH, token_idx_N, num_tokens: int):
        ctx.save_for_backward(token_idx_N)
        return rows_NH.new_zeros((num_tokens,) + tuple(rows_NH.shape[1:])).index_add_(0, token_idx_N, rows_NH)

    @staticmethod
    def backward(ctx, g_TH):
        (token_idx_N,) = ctx.saved_tensors
        return g_TH.index_select(0, token_idx_N), None, None


def check_dropless(counts: Sequence[Sequence[Sequence[int]]], num_tokens: int, topk: int) -> None:
    """Raise ``ValueError`` unless every rank's counts ``counts[s][j]`` (per expert, ``[EP][ETP][E]``)
    sum to ``num_tokens·topk``. Every rank holds every rank's counts after the count gather, so all
    ranks of the domain check all of them: a short map on one rank raises the same error everywhere
    before any token moves (instead of on that rank alone, leaving its peers in the exchange)."""
    want = num_tokens * topk
    short = [(i, j, sum(c)) for i, row in enumerate(counts) for j, c in enumerate(row) if sum(c) != want]
    if short:
        where = ", ".join(f"ep rank {i} etp rank {j}: {n}" for i, j, n in short)
        raise ValueError(
            f"dropless dispatch expects exactly topk={topk} experts per token "
            f"({want} pairs per rank) but the routing map holds {where}; set "
            f"capacity_factor if the router drops tokens"
        )


def chunk_permutation(split_sizes: Sequence[int], sorted_idxs: Sequence[int]) -> List[int]:
    """Row indices that reorder chunks: ``x[perm]`` == the chunks of ``x`` (sizes ``split_sizes``) in the
    order ``sorted_idxs``."""
    starts = [0]
    for s in split_sizes:
        starts.append(starts[-1] + s)
    perm: List[int] = []
    for i in sorted_idxs:
        perm.extend(range(starts[i], starts[i + 1]))
    return perm


def sort_chunks_by_idxs(x: torch.Tensor, split_sizes: Sequence[int], sorted_idxs: Sequence[int]) -> torch.Tensor:
    """Split dim 0 of ``x`` into chunks of ``split_sizes`` and concatenate them in the order ``sorted_idxs``.

    Differentiable (the gradient is reordered back). ``sum(split_sizes)`` must equal ``x.shape[0]``.
    """
    if sum(split_sizes) != x.shape[0]:
        raise ValueError(f"sort_chunks_by_idxs: split sizes sum to {sum(split_sizes)} but x has {x.shape[0]} rows")
    chunks = torch.split(x, list(split_sizes), dim=0)
    return torch.cat([chunks[i] for i in sorted_idxs], dim=0)


def inverse_order(order: Sequence[int]) -> List[int]:
    """The permutation that undoes ``order`` (``inverse[order[i]] = i``)."""
    inv = [0] * len(order)
    for i, o in enumerate(order):
        inv[o] = i
    return inv


@dataclasses.dataclass(frozen=True)
class AllToAllPlan:
    """Host-side split sizes of one all-to-all dispatch (see :func:`plan_alltoall`)."""

    input_splits: List[int]
    """Rows this rank sends to each EP rank (its permuted rows are already grouped this way)."""
    output_splits: List[int]
    """Rows this rank receives from each EP rank in the EP all-to-all."""
    etp_sizes: List[int]
    """Rows each ETP rank of this rank's ETP group holds after the EP all-to-all."""
    chunk_sizes: List[int]
    """Chunk sizes after the ETP all-gather, in rank-major order ``[etp j][ep src s][local expert l]``."""
    sort_idxs: List[int]
    """Chunk order that makes the gathered rows expert-major (``l``, then ``j``, then ``s``)."""
    tokens_per_expert: List[int]
    """Rows each local expert receives."""
    num_out_tokens: int
    """Rows this rank permutes and sends (its kept (token, expert) pairs)."""
    remote_rows: int
    """Rows this rank sends to other EP ranks (the hidden payload of the EP all-to-all)."""
    expert_slices: List[Tuple[List[int], List[int]]] = dataclasses.field(default_factory=list)
    """Without ETP: for each local expert index ``l``, ``(send, recv)``: the rows this rank sends to
    expert ``l`` of each EP rank and receives for its own expert ``l`` from each EP rank. An EP
    all-to-all run as one call per ``l`` over rows permuted in expert order ``(l, d)`` (see
    :func:`expert_order`) delivers them expert-major, with no sort. Empty with ETP > 1."""

    @property
    def sorted_chunk_sizes(self) -> List[int]:
        """Chunk sizes in expert-major order (the layout the experts see)."""
        return [self.chunk_sizes[i] for i in self.sort_idxs]


def plan_alltoall(
    counts: Sequence[Sequence[Sequence[int]]],
    *,
    ep_size: int,
    etp_size: int,
    ep_rank: int,
    etp_rank: int,
    num_local_experts: int,
) -> AllToAllPlan:
    """Split sizes of the all-to-all dispatcher from every rank's per-expert counts.

    Args:
        counts: ``counts[s][j][e]`` = rows that the rank with EP index ``s`` and ETP index ``j`` (of
            this rank's ETP×EP domain) sends to global expert ``e``; nested lists ``[EP][ETP][E]``.
        ep_size, etp_size, ep_rank, etp_rank: this rank's coordinates in the expert view.
        num_local_experts: ``L = E / EP``; EP rank ``d`` owns experts ``[d*L, (d+1)*L)``.
    """
    L = num_local_experts
    if len(counts) != ep_size or any(len(c) != etp_size for c in counts):
        raise ValueError(f"plan_alltoall: counts must be [EP={ep_size}][ETP={etp_size}][E] nested lists")
    E = len(counts[0][0])
    if E != ep_size * L:
        raise ValueError(f"plan_alltoall: {E} experts in counts but EP*L = {ep_size}*{L}")
    mine = counts[ep_rank][etp_rank]
    local = range(ep_rank * L, (ep_rank + 1) * L)
    input_splits = [sum(mine[d * L : (d + 1) * L]) for d in range(ep_size)]
    output_splits = [sum(counts[s][etp_rank][e] for e in local) for s in range(ep_size)]
    etp_sizes = [sum(counts[s][j][e] for s in range(ep_size) for e in local) for j in range(etp_size)]
    chunk_sizes = [counts[s][j][e] for j in range(etp_size) for s in range(ep_size) for e in local]
    sort_idxs = [(j * ep_size + s) * L + l for l in range(L) for j in range(etp_size) for s in range(ep_size)]
    tokens_per_expert = [sum(counts[s][j][e] for s in range(ep_size) for j in range(etp_size)) for e in local]
    num_out = sum(mine)
    slices = []
    if etp_size == 1:
        slices = [
            ([mine[d * L + l] for d in range(ep_size)], [counts[s][0][ep_rank * L + l] for s in range(ep_size)])
            for l in range(L)
        ]
    return AllToAllPlan(
        input_splits=input_splits,
        output_splits=output_splits,
        etp_sizes=etp_sizes,
        chunk_sizes=chunk_sizes,
        sort_idxs=sort_idxs,
        tokens_per_expert=tokens_per_expert,
        num_out_tokens=num_out,
        remote_rows=num_out - input_splits[ep_rank],
        expert_slices=slices,
    )


def expert_order(num_experts: int, ep_size: int, *, device=None) -> torch.Tensor:
    """Global experts in the order ``(local index l, EP rank d)``: ``[0, L, 2L, ..., 1, L+1, ...]``,
    as an int64 tensor built on ``device`` (no host-to-device copy). Rows permuted in this order (the
    routing map's columns reordered) are grouped by local expert index, and within it by destination
    rank: the send layout of a per-local-expert EP all-to-all (:attr:`AllToAllPlan.expert_slices`).
    The inverse permutation is ``expert_order(num_experts, num_experts // ep_size)``."""
    L = num_experts // ep_size
    return torch.arange(num_experts, device=device).view(ep_size, L).t().reshape(-1)
