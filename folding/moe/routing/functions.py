"""Routing math as pure functions: top-k selection, capacity, load-balancing losses, expert bias.

Nothing here touches a process group: the :class:`~folding.moe.routing.router.Router` module reduces token
counts over the right group and passes them in. The semantics are Megatron-Core's
(``topk_routing_with_score_function``, ``apply_router_token_dropping``,
``switch_load_balancing_loss_func``, ``z_loss_func``, ``get_updated_expert_bias``), so the same
arguments give the same results; where Megatron-Core leaves a choice to ``torch.topk`` tie-breaking
(capacity dropping), the choice here is deterministic and documented.

Shape suffixes of tensor names (docs/shapes.md):
    T  tokens (local to this rank unless said otherwise)   E  global experts
    K  top-k choices per token                             G  expert groups
    B  sequences of a micro-batch                          S  sequence positions
    Tk tokens an expert keeps (its capacity)

Output conventions: ``probs_TE`` is dense with zeros off the chosen experts; ``routing_map_TE`` is a
bool mask of the chosen (token, expert) pairs.

Usage::

    probs_TE, map_TE = topk_routing(logits_TE, topk=2)
    probs_TE, map_TE = apply_capacity(probs_TE, map_TE, topk=2, capacity_factor=1.0)
    scores_TE, aux_map_TE = aux_loss_scores(logits_TE, topk=2)
    loss = switch_aux_loss(scores_TE, aux_map_TE.sum(0), total_num_tokens=T, topk=2,
                           num_experts=E, coeff=1e-2)
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

Tensor = torch.Tensor


# ------------------------------------------------------------------------------------ helpers
def _softmax(x: Tensor) -> Tensor:
    """Softmax over the last dim, in fp32 at least, returned in ``x``'s dtype."""
    dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    return torch.softmax(x, dim=-1, dtype=dtype).to(x.dtype)


def _check_logits(logits_TE: Tensor, topk: int, name: str = "logits_TE") -> Tuple[int, int]:
    if logits_TE.dim() != 2:
        raise ValueError(f"{name} must be 2-D [tokens, experts], got shape {tuple(logits_TE.shape)}")
    T, E = logits_TE.shape
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= E:
        raise ValueError(f"topk={topk!r} must be an integer in [1, num_experts={E}]")
    return T, E


def _group_limited_topk(
    scores_TE: Tensor, topk: int, num_groups: int, group_topk: int, group_score_topk: Optional[int] = None
) -> Tensor:
    """Indices [T, K] of the top-k experts among the ``group_topk`` best groups of each token.

    A group's score is the sum of its top ``group_score_topk`` scores (``None``: ``topk // group_topk``,
    Megatron-Core's rule; DeepSeek-V3 uses 2); experts of the other groups are masked to -inf before
    the final top-k.
    """
    T, E = scores_TE.shape
    if E % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide the {E} experts")
    per_group = E // num_groups
    if group_score_topk is None:
        if not 1 <= group_topk <= min(num_groups, topk):
            raise ValueError(f"group_topk={group_topk} must be in [1, min(num_groups, topk)]")
        group_score_topk = topk // group_topk
    elif not 1 <= group_topk <= num_groups:
        raise ValueError(f"group_topk={group_topk} must be in [1, num_groups={num_groups}]")
    if not 1 <= group_score_topk <= per_group or group_topk * per_group < topk:
        raise ValueError(
            f"topk={topk} cannot be drawn from group_topk={group_topk} groups of {per_group} "
            f"scored by their top {group_score_topk}"
        )
    group_scores_TG = scores_TE.view(T, num_groups, per_group).topk(group_score_topk, dim=-1).values.sum(-1)
    group_idx_TG = group_scores_TG.topk(group_topk, dim=-1).indices
    group_mask_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter(1, group_idx_TG, True)
    expert_mask_TE = group_mask_TG.unsqueeze(-1).expand(T, num_groups, per_group).reshape(T, E)
    return scores_TE.masked_fill(~expert_mask_TE, float("-inf")).topk(topk, dim=-1).indices


def _probs_from_choice(
    logits_TE: Tensor,
    scores_TE: Tensor,
    idx_TK: Tensor,
    *,
    score_function: str,
    pre_softmax: bool,
    scaling_factor: Optional[float],
) -> Tuple[Tensor, Tensor]:
    """Dense probs and routing map from the chosen expert indices ``idx_TK``."""
    vals_TK = scores_TE.gather(1, idx_TK)
    if score_function == "softmax" and not pre_softmax:
        vals_TK = _softmax(vals_TK)  # scores are the logits here
    elif score_function == "sigmoid" and idx_TK.shape[1] > 1:
        vals_TK = vals_TK / (vals_TK.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor is not None:
        vals_TK = vals_TK * scaling_factor
    probs_TE = torch.zeros_like(logits_TE).scatter(1, idx_TK, vals_TK)
    routing_map_TE = torch.zeros_like(logits_TE, dtype=torch.bool).scatter(1, idx_TK, True)
    return probs_TE, routing_map_TE


def _scores(logits_TE: Tensor, score_function: str, pre_softmax: bool) -> Tensor:
    if score_function == "softmax":
        if pre_softmax:
            return _softmax(logits_TE)
        return logits_TE
    if score_function == "sigmoid":
        if pre_softmax:
            raise ValueError("pre_softmax=True only applies to score_function='softmax'")
        return torch.sigmoid(logits_TE)
    raise ValueError(f"score_function={score_function!r} must be 'softmax' or 'sigmoid'")


# ------------------------------------------------------------------------------------- top-k
def topk_routing(
    logits_TE: Tensor,
    *,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
    expert_bias_E: Optional[Tensor] = None,
    group_score_topk: Optional[int] = None,
    scores_TE: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Choose ``topk`` experts per token and their probabilities.

    - ``softmax``, ``pre_softmax=False``: top-k of the logits, softmax over the k chosen logits.
    - ``softmax``, ``pre_softmax=True``: softmax over all E experts, then top-k (not renormalized).
    - ``sigmoid``: sigmoid scores, top-k, renormalized to sum 1 when k > 1.

    ``num_groups``/``group_topk`` restrict the choice to the best ``group_topk`` of ``num_groups``
    contiguous expert groups, a group scored by the sum of its top ``group_score_topk`` scores
    (``None``: ``topk // group_topk``). ``expert_bias_E`` is added to the scores (the logits for post-top-k
    softmax) for the *choice only*: the returned probabilities never include it.
    ``scaling_factor`` multiplies the final probabilities. ``scores_TE``: the scores of ``logits_TE`` under
    the score function when the caller already has them (:func:`full_scores` for ``pre_softmax`` and sigmoid, shared
    with :func:`aux_loss_scores` so that one copy is kept for backward); ``None``: computed here.

    Returns ``(probs_TE, routing_map_TE)``: dense probs in ``logits_TE``'s dtype (zero off the
    top-k) and a bool map of the chosen experts.
    """
    _check_logits(logits_TE, topk)
    if (num_groups is None) != (group_topk is None):
        raise ValueError("group-limited routing needs both num_groups and group_topk (or neither)")
    if scores_TE is None:
        scores_TE = _scores(logits_TE, score_function, pre_softmax)
    select_TE = scores_TE if expert_bias_E is None else scores_TE + expert_bias_E.to(scores_TE.dtype)
    if num_groups is None:
        idx_TK = select_TE.topk(topk, dim=-1).indices
    else:
        idx_TK = _group_limited_topk(select_TE, topk, num_groups, group_topk, group_score_topk)
    return _probs_from_choice(
        logits_TE,
        scores_TE,
        idx_TK,
        score_function=score_function,
        pre_softmax=pre_softmax,
        scaling_factor=scaling_factor,
    )


def balanced_routing(
    logits_TE: Tensor,
    *,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    scaling_factor: Optional[float] = None,
    offset: int = 0,
) -> Tuple[Tensor, Tensor]:
    """Force-balanced routing for benchmarks: token ``t``'s j-th choice is expert
    ``(offset + t·k + j) mod E``, so every expert gets ⌊T·k/E⌋ or ⌈T·k/E⌉ tokens.

    Probabilities are computed from the real logits of the forced choice exactly as in
    :func:`topk_routing`, so the router still receives gradients. Returns ``(probs_TE, routing_map_TE)``.
    """
    T, E = _check_logits(logits_TE, topk)
    scores_TE = _scores(logits_TE, score_function, pre_softmax)
    pos_TK = torch.arange(T, device=logits_TE.device).unsqueeze(1) * topk + torch.arange(topk, device=logits_TE.device)
    idx_TK = (pos_TK + offset) % E
    return _probs_from_choice(
        logits_TE,
        scores_TE,
        idx_TK,
        score_function=score_function,
        pre_softmax=pre_softmax,
        scaling_factor=scaling_factor,
    )


# ------------------------------------------------------------------------------------ capacity
def expert_capacity(num_tokens: int, *, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Rows an expert may receive: ``ceil(num_tokens·topk / num_experts · capacity_factor)``."""
    if capacity_factor is None or not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor!r} must be > 0 (None means dropless)")
    return math.ceil((num_tokens * topk / num_experts) * capacity_factor)


def apply_capacity(
    probs_TE: Tensor,
    routing_map_TE: Tensor,
    *,
    topk: int,
    capacity_factor: float,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Drop the (token, expert) pairs beyond each expert's capacity, decided from these tokens only.

    ``capacity = ceil(T·topk/E · capacity_factor)`` (:func:`expert_capacity`). Per expert, the routed tokens are
    ranked by ``drop_policy``: ``"probs"`` by probability (highest first), ``"position"`` by token
    index (earliest first); ties keep the earlier token. The first ``capacity`` are kept, so an
    expert keeps ``min(routed, capacity)`` rows.

    With ``pad_to_capacity`` every expert gets exactly ``min(capacity, T)`` rows: after its routed
    tokens come filler tokens (earliest first) with probability 0. When ``capacity >= T`` that makes
    every token go to every expert, as Megatron-Core does.

    Returns ``(probs_TE, routing_map_TE)`` with dropped pairs zeroed / cleared.
    """
    if probs_TE.shape != routing_map_TE.shape or probs_TE.dim() != 2:
        raise ValueError(
            f"probs_TE {tuple(probs_TE.shape)} and routing_map_TE "
            f"{tuple(routing_map_TE.shape)} must have the same 2-D shape"
        )
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"drop_policy={drop_policy!r} must be 'probs' or 'position'")
    T, E = probs_TE.shape
    capacity = expert_capacity(T, topk=topk, num_experts=E, capacity_factor=capacity_factor)
    keep = min(capacity, T)
    if drop_policy == "probs":
        # routed pairs carry probs >= 0; unrouted ones rank after every routed one (filler order)
        rank_key_TE = torch.where(routing_map_TE, probs_TE.detach(), torch.full_like(probs_TE, -1.0))
    else:
        rank_key_TE = routing_map_TE.to(probs_TE.dtype)
    # stable descending sort: equal keys keep token order (earliest first)
    kept_idx_TkE = torch.sort(rank_key_TE, dim=0, descending=True, stable=True).indices[:keep]
    capacity_mask_TE = torch.zeros_like(routing_map_TE).scatter(0, kept_idx_TkE, True)
    new_map_TE = capacity_mask_TE if pad_to_capacity else routing_map_TE & capacity_mask_TE
    return probs_TE * new_map_TE, new_map_TE


# -------------------------------------------------------------------------------------- losses
def full_scores(logits_TE: Tensor, score_function: str) -> Tensor:
    """The score function over all E experts of every token: softmax (in fp32 at least) or sigmoid. The
    scores of ``pre_softmax`` and ``sigmoid`` routing and the base of the load-balancing losses' scores,
    which can share them (``scores_TE=`` of :func:`topk_routing` and :func:`aux_loss_scores`): one copy
    kept for backward instead of two."""
    return _scores(logits_TE, score_function, pre_softmax=score_function == "softmax")


def aux_loss_scores(
    logits_TE: Tensor,
    *,
    topk: int,
    score_function: str = "softmax",
    padding_mask_T: Optional[Tensor] = None,
    scores_TE: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Scores and top-k map the load-balancing losses use: full scores over all E experts for every
    token (softmax, or sigmoid normalized to sum 1) and the plain top-k of those scores (no groups,
    no expert bias, no dropping). Tokens where ``padding_mask_T`` is True get zero scores and an
    empty map, so they count nowhere. ``scores_TE``: :func:`full_scores` of ``logits_TE`` when the caller
    has them. Returns ``(scores_TE, routing_map_TE)``."""
    _check_logits(logits_TE, topk)
    if score_function == "softmax":
        scores_TE = _softmax(logits_TE) if scores_TE is None else scores_TE
    elif score_function == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE) if scores_TE is None else scores_TE
        scores_TE = scores_TE / (scores_TE.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function={score_function!r} must be 'softmax' or 'sigmoid'")
    idx_TK = scores_TE.topk(topk, dim=-1).indices
    routing_map_TE = torch.zeros_like(scores_TE, dtype=torch.bool).scatter(1, idx_TK, True)
    if padding_mask_T is not None:
        valid_T1 = ~padding_mask_T.reshape(-1, 1).bool()
        scores_TE, routing_map_TE = scores_TE * valid_T1, routing_map_TE & valid_T1
    return scores_TE, routing_map_TE


def switch_aux_loss(
    scores_TE: Tensor, tokens_per_expert_E: Tensor, *, total_num_tokens: int, topk: int, num_experts: int, coeff: float
) -> Tensor:
    """Switch/GShard load-balancing loss ``E·coeff/(k·T²) · Σ_e (Σ_t scores[t,e]) · n_e``.

    ``scores_TE`` may be this rank's share of the tokens and ``tokens_per_expert_E`` (n_e) the counts
    over all ``total_num_tokens`` (T) tokens: the results of the ranks holding the shares then sum to
    the loss of the whole batch. Gradient flows through ``scores_TE`` only.
    """
    scale = num_experts * coeff / (topk * total_num_tokens * total_num_tokens)
    return (scores_TE.sum(dim=0) * tokens_per_expert_E.to(scores_TE.dtype)).sum() * scale


def tokens_per_sequence_expert(routing_map_TE: Tensor, *, num_sequences: int) -> Tensor:
    """Counts [B, E] of routed tokens per (sequence, expert); tokens are ordered ``[S_local, B]``
    (token ``t = s·B + b``), the order of the attention layout ``[S, B, H]`` flattened."""
    T, E = routing_map_TE.shape
    if T % num_sequences:
        raise ValueError(f"{T} local tokens are not a whole number of num_sequences={num_sequences}")
    return routing_map_TE.view(T // num_sequences, num_sequences, E).sum(dim=0)


def seq_aux_loss(
    scores_TE: Tensor,
    tokens_per_seq_expert_BE: Tensor,
    *,
    num_sequences: int,
    seq_length: Union[int, Tensor],
    topk: int,
    num_experts: int,
    coeff: float,
) -> Tensor:
    """Sequence-level load-balancing loss: :func:`switch_aux_loss` of every sequence (T = the full
    ``seq_length``), averaged over the ``num_sequences`` sequences of the micro-batch.

    ``scores_TE`` are this rank's tokens in ``[S_local, B]`` order; ``tokens_per_seq_expert_BE`` the
    counts over the whole sequences (summed over the ranks holding parts of them). ``seq_length``
    may be a ``[B]`` tensor of per-sequence (unpadded) lengths.
    """
    T, E = scores_TE.shape
    if T % num_sequences:
        raise ValueError(f"{T} local tokens are not a whole number of num_sequences={num_sequences}")
    scores_BE = scores_TE.view(T // num_sequences, num_sequences, E).sum(dim=0)
    if isinstance(seq_length, Tensor):
        seq_length = seq_length.to(scores_BE.dtype).clamp_min(1).reshape(num_sequences, 1)
    scale = num_experts * coeff / (topk * seq_length * seq_length)
    return (scores_BE * tokens_per_seq_expert_BE.to(scores_BE.dtype) * scale).sum() / num_sequences


def z_loss(
    logits_TE: Tensor,
    *,
    coeff: float,
    padding_mask_T: Optional[Tensor] = None,
    total_num_tokens: Union[int, Tensor, None] = None,
) -> Tensor:
    """Router z-loss ``coeff · Σ_t logsumexp_e(logits)² / N`` (ST-MoE), the sum over the tokens that
    are not padding. N defaults to their number (a mean); pass ``total_num_tokens`` when these
    tokens are one rank's share of N, so that the ranks' results sum to the batch's loss."""
    lse2_T = torch.logsumexp(logits_TE, dim=-1).square()
    if padding_mask_T is not None:
        lse2_T = lse2_T * ~padding_mask_T.reshape(-1).bool()
    if total_num_tokens is None:
        total_num_tokens = lse2_T.numel() if padding_mask_T is None else (~padding_mask_T.bool()).sum()
    if isinstance(total_num_tokens, Tensor):
        total_num_tokens = total_num_tokens.to(lse2_T.dtype).clamp_min(1)
    return lse2_T.sum() * coeff / total_num_tokens


# --------------------------------------------------------------------------------- expert bias
def updated_expert_bias(expert_bias_E: Tensor, tokens_per_expert_E: Tensor, *, rate: float) -> Tensor:
    """Aux-loss-free balancing step: ``bias + rate · sign(mean(n) − n)``.

    ``tokens_per_expert_E`` (n) are the counts of a whole global batch (over TP×DP×CP); an expert
    with more than the mean load moves down by ``rate``, one with less moves up, one at the mean
    stays. Returns a new tensor in ``expert_bias_E``'s dtype.
    """
    counts_E = tokens_per_expert_E.to(torch.float64)
    return expert_bias_E + torch.sign(counts_E.mean() - counts_E).to(expert_bias_E.dtype) * rate
