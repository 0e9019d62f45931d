"""Evaluation on the held-out split: the token-weighted mean LM loss over ``train.eval_steps`` global batches.

Runs forward only (no gradient, dropout-free model in ``eval()`` mode: routers skip jitter and
losses), with the same loss masking as training (padding and, with ``data.eod_mask_loss``,
end-of-document tokens excluded). The result is the same on every layout for the same data.

Usage::

    rec = evaluate(chunks, data.valid, parallel_state=ps, num_microbatches=M, eval_steps=2)
    rec["lm_loss"], rec["ppl"]
"""

from __future__ import annotations

import math
from typing import Dict, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..pipeline.stage import run_microbatches


def global_token_count(microbatches, *, dp_group, device) -> torch.Tensor:
    """Collective over the attention DP group (all-reduce, sum; no backward): the number of unmasked
    tokens of the global batch. TP and CP ranks hold the same full sequences, so DP is enough."""
    local = sum(float(mb["loss_mask"].sum()) for mb in microbatches)
    count = torch.tensor([local], dtype=torch.float64, device=device)
    dist.all_reduce(count, group=dp_group)
    return count


@torch.no_grad()
def evaluate(
    chunks: Sequence[nn.Module], valid_iter, *, parallel_state, num_microbatches: int, eval_steps: int, device
) -> Dict[str, float]:
    """Mean LM loss (and perplexity) of ``eval_steps`` global batches from ``valid_iter``.

    Collective over the world (one all-reduce per global batch for the loss sum, one over DP for the
    token count).
    """
    ps = parallel_state
    was_training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
    tokens = torch.zeros(1, dtype=torch.float64, device=device)
    try:
        for _ in range(eval_steps):
            mbs = [next(valid_iter) for _ in range(num_microbatches)]
            tokens += global_token_count(mbs, dp_group=ps.groups.dp, device=device)
            out = run_microbatches(chunks, mbs, parallel_state=ps, loss_scale=1.0, forward_only=True)
            part = out["lm_loss_sum"].to(device=device, dtype=torch.float64).view(1)
            # Per-token losses are identical on the TP ranks of the last stage: count them once.
            part = part / ps.layout.tp if ps.is_last_stage else torch.zeros_like(part)
            dist.all_reduce(part)
            loss_sum += part
    finally:
        for c, mode in zip(chunks, was_training):
            c.train(mode)
    lm_loss = float(loss_sum / tokens.clamp(min=1.0))
    return {"lm_loss": lm_loss, "ppl": math.exp(min(lm_loss, 50.0)), "tokens": int(tokens)}
