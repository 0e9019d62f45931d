"""Context parallelism: load-balanced causal sequence chunks and the K/V all-gather.

The sequence of length S is cut into ``2*CP`` equal chunks; CP rank ``i`` holds chunks ``i`` and
``2*CP-1-i`` (in that order), so every rank gets the same amount of causal-attention work. Each
rank computes Q, K, V for its own tokens, all-gathers K and V over the CP group (forward: all-gather;
backward: reduce-scatter of the K/V gradients, since every rank's queries contribute to every
key's gradient), sorts them into sequence order, and attends once per local chunk: a chunk starting
at position ``p`` attends keys ``[0, p + c)`` with a lower-right causal bias, which fused SDPA
kernels support (no dense mask) and which skips the keys after the chunk.
All-gather was chosen over a ring: it is exact, simple, and its communication is one collective per
layer; its cost is the memory of the full K/V of the (local heads of the) sequence.

Usage::

    pos_S = cp_positions(seq_len, cp_rank, cp_size)           # this rank's token positions
    ids_BSl = input_ids_BS[:, pos_S]
    k_full = gather_kv(k_SBND, cp_group)                       # [S, B, heads, D] in rank order
    kv_order = gathered_positions(seq_len, cp_size).argsort()  # sorts k_full into sequence order
    out_BNSD = causal_sdpa(q_BASD, k_BASD, v_BASD, scale=d**-0.5, chunk_starts=chunk_starts)
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..parallel.collectives import gather_from_sequence_region, group_size
from .dropout import probs_dropout


def check_cp_seq_len(seq_len: int, cp_size: int, tp_size: int) -> None:
    """Raise a clear error if ``seq_len`` cannot be split over CP chunks and TP (sequence parallel)."""
    if cp_size > 1 and seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2*parallel.cp = {2 * cp_size}; "
            f"choose a sequence length that is a multiple of {2 * cp_size}"
        )
    local = seq_len // cp_size
    if local % tp_size:
        raise ValueError(
            f"sequence length {seq_len} / parallel.cp={cp_size} = {local} is not divisible by "
            f"parallel.tp={tp_size} (sequence parallelism); choose a sequence length that is a "
            f"multiple of {cp_size * tp_size * (2 if cp_size > 1 else 1)}"
        )


def cp_positions(seq_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Positions (int64) of the tokens held by CP rank ``cp_rank``: chunks ``cp_rank`` and ``2*cp-1-cp_rank``."""
    if cp_size == 1:
        return torch.arange(seq_len, device=device)
    c = seq_len // (2 * cp_size)
    a = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    j = 2 * cp_size - 1 - cp_rank
    b = torch.arange(j * c, (j + 1) * c, device=device)
    return torch.cat([a, b])


def gathered_positions(seq_len: int, cp_size: int, device=None) -> torch.Tensor:
    """Positions of the rows of a tensor all-gathered over CP (rank order of the local chunks)."""
    return torch.cat([cp_positions(seq_len, r, cp_size, device) for r in range(cp_size)])


def gather_kv(x_SBAD: torch.Tensor, cp_group) -> torch.Tensor:
    """All-gather K or V along the sequence over CP.

    Forward: all-gather along dim 0 (rank order). Backward: reduce-scatter (sum) of the gradient.
    """
    if group_size(cp_group) == 1:
        return x_SBAD
    return gather_from_sequence_region(x_SBAD, cp_group, grad_reduce=True)


def causal_sdpa(
    q_BASD: torch.Tensor, k_BASD: torch.Tensor, v_BASD: torch.Tensor, *, scale: float, chunk_starts, **kw
) -> torch.Tensor:
    """Causal SDPA of this rank's queries over keys/values in sequence order.

        Without CP (``chunk_starts == (0,)`` and as many keys as queries) one causal call. Under CP the
        queries are this rank's chunks (``chunk_starts`` their first positions) and the keys the whole
        gathered sequence: each chunk starting at ``p`` attends keys ``[0, p + c)`` with a lower-right
        causal bias. The value width may differ from the query/key width (multi-head latent attention);
    on CPU the values are then zero-padded to the query width, so that PyTorch's flash kernel (which
    keeps no ``[S, S]`` probabilities) runs: the kernel keeps values and output ``D`` wide there, not
    ``Dv``. Returns ``[B, A, S_q, Dv]``.
    """
    dv = v_BASD.shape[-1]
    if dv != q_BASD.shape[-1] and q_BASD.device.type == "cpu":
        # PyTorch's CPU flash kernel needs one width for q, k and v, and without it SDPA falls back to
        # the math path, which keeps the fp32 [S, S] probabilities of every head: zero-pad the values
        # to the query width (their columns add nothing) and drop the extra output columns
        v_BASD = sdpa_values(v_BASD, q_BASD.shape[-1])
        return causal_sdpa(q_BASD, k_BASD, v_BASD, scale=scale, chunk_starts=chunk_starts, **kw)[..., :dv]
    if len(chunk_starts) == 1 and k_BASD.shape[2] == q_BASD.shape[2]:
        return F.scaled_dot_product_attention(q_BASD, k_BASD, v_BASD, is_causal=True, scale=scale, **kw)
    # imported here, not with the module: it imports torch._dynamo (about 1 s of CPU in every process
    # that imports the model, which only context parallelism's chunked causal attention needs)
    from torch.nn.attention.bias import causal_lower_right

    c = q_BASD.shape[2] // len(chunk_starts)
    outs = []
    for j, start in enumerate(chunk_starts):
        end = start + c
        outs.append(
            F.scaled_dot_product_attention(
                q_BASD[:, :, j * c : (j + 1) * c],
                k_BASD[:, :, :end],
                v_BASD[:, :, :end],
                attn_mask=causal_lower_right(c, end),
                scale=scale,
                **kw,
            )
        )
    return torch.cat(outs, dim=2)


def attention_core(
    q_BASD,
    k_BASD,
    v_BASD,
    *,
    scale: float,
    chunk_starts,
    recompute: bool = False,
    dropout=None,
    head_offset: int = 0,
    **kw,
):
    """:func:`causal_sdpa`, under a checkpoint when ``recompute`` (the ``core_attn`` recompute module:
    the kernel's output and statistics are not kept, the core runs again in backward) and autograd is on.
    With ``dropout`` (the layer's :class:`~folding.model.dropout.DropoutKeys`) at an attention rate above
    0: :func:`dropout_attention` instead (``head_offset``: the global index of this rank's first head)."""
    if dropout is not None and dropout.attention:
        fn = functools.partial(dropout_attention, scale=scale, dropout=dropout, head_offset=head_offset)
    else:
        fn = functools.partial(causal_sdpa, scale=scale, chunk_starts=chunk_starts, **kw)
    if recompute and torch.is_grad_enabled():
        return checkpoint(fn, q_BASD, k_BASD, v_BASD, use_reentrant=False)
    return fn(q_BASD, k_BASD, v_BASD)


def dropout_attention(q_BASD, k_BASD, v_BASD, *, scale: float, dropout, head_offset: int) -> torch.Tensor:
    """Causal attention with dropout on the probabilities, unfused: ``softmax(q kᵀ · scale)`` (fp32) with
    every key after the query's position masked, then :func:`~folding.model.dropout.probs_dropout`, then
    the values. Queries sit at ``dropout.query_positions_S`` (this CP rank's positions), keys and values
    are the whole prefix in sequence order (``Sk`` positions ``0 .. Sk-1``), grouped-query heads are
    shared as in :func:`causal_sdpa`. Returns ``[B, A, S, Dv]``; keeps the ``[B, A, S, Sk]`` probabilities."""
    A, K = q_BASD.shape[1], k_BASD.shape[1]
    if A != K:  # query head j reads key/value head j // (A / K)
        k_BASD, v_BASD = k_BASD.repeat_interleave(A // K, dim=1), v_BASD.repeat_interleave(A // K, dim=1)
    scores_BASSk = (q_BASD @ k_BASD.transpose(-1, -2)).float() * scale
    q_pos = dropout.query_positions_S.to(q_BASD.device)
    future_SSk = torch.arange(k_BASD.shape[2], device=q_BASD.device)[None, :] > q_pos[:, None]
    probs_BASSk = torch.softmax(scores_BASSk.masked_fill(future_SSk, float("-inf")), dim=-1)
    probs_BASSk = probs_dropout(probs_BASSk, dropout, head_offset).to(v_BASD.dtype)
    return probs_BASSk @ v_BASD


def sdpa_values(v_BASD: torch.Tensor, qk_width: int) -> torch.Tensor:
    """The values as the attention kernel of this device takes them, in a storage of their own (the kernel
    keeps them for backward: a view would keep the whole buffer it is cut from, MLA's KV up-projection
    output with its key halves): on CPU zero-padded to the query/key width when narrower (PyTorch's CPU
    flash kernel needs one width; see :func:`causal_sdpa`), elsewhere a contiguous copy when ``v_BASD`` is a
    view. Slice the core's output back to ``v_BASD``'s width."""
    if v_BASD.shape[-1] != qk_width and v_BASD.device.type == "cpu":
        return F.pad(v_BASD, (0, qk_width - v_BASD.shape[-1]))
    return v_BASD.contiguous()
