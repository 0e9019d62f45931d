"""One step's micro-batches through the pipeline schedule, on this rank's model chunks
(:func:`folding.model.chunks.build_stage_chunks`).

``run_microbatches`` runs the step's micro-batches through the schedule of
:mod:`.schedules` (no pipelining, 1F1B or interleaved). Loss contract: micro-batch ``m``
contributes ``masked_loss_sum_m · loss_scale`` to the objective; with ``loss_scale = 1 / global
unmasked token count`` the gradients are *summed* over DP×CP and EDP (docs/optimizer.md, "The loss contract") and do not
depend on PP, VPP or the number of micro-batches.

Usage::

    out = run_microbatches(chunks, microbatches, parallel_state=ps, loss_scale=1 / n_tokens)
    out["lm_loss_sum"]      # this rank's masked loss sum (last stage; 0 elsewhere)
    out["mtp_loss_sum"]     # its multi-token-prediction loss sum (0 without MTP)
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from ..model.chunks import step_scope
from ..overlap.runtime import OverlapRuntime
from .p2p import P2P
from .schedules import forward_backward


def run_microbatches(
    chunks: Sequence[nn.Module],
    microbatches: Sequence[Dict[str, torch.Tensor]],
    *,
    parallel_state,
    loss_scale: float,
    forward_only: bool = False,
    no_sync: Optional[Callable[[], contextlib.AbstractContextManager]] = None,
    overlap: bool = False,
    runtime: Optional[OverlapRuntime] = None,
) -> Dict[str, torch.Tensor]:
    """Forward (and, unless ``forward_only``, backward) every micro-batch of one step.

    ``microbatches[m]`` holds full ``tokens``, ``labels`` and ``loss_mask`` ``[MBS, S]`` (the same on
    every TP/CP/PP rank of one data-parallel replica), and ``sample_index [MBS]`` (each sequence's global
    sample index, the dropout masks' coordinate; needed only with dropout). ``no_sync`` (the optimizer's),
    when given, is entered around every backward but each chunk's last micro-batch: during that last backward the
    optimizer's buckets start reducing as their gradients complete (Megatron-Core's
    ``overlap_grad_reduce``, per model chunk), behind the rest of the schedule; the caller's
    optimizer step completes the reduction. The schedule runs inside the chunks' per-step duties
    (:func:`folding.model.chunks.step_scope`: the MoE layers with replica slots fetch their replicas'
    weights once for the step and return their gradients when the schedule ends).
    With multi-token prediction the objective adds ``mtp_loss_scaling_factor`` times the MTP loss
    sum (:class:`~folding.model.transformer.MoETransformer`).
    Returns ``{"lm_loss_sum": float64 tensor, "mtp_loss_sum": float64 tensor}``: the detached masked LM
    loss sum of this rank's micro-batches on the last pipeline stage, and the sum of their MTP losses
    (the mean over the depths, per token; 0 without MTP), both 0 on other stages.
    ``overlap`` (``parallel.overlap_moe_comm``): the steady state runs each forward merged with a
    backward, their MoE exchanges hidden behind each other's compute (bitwise the same results); the
    experts resolve their backends (and run their first-use probes) before the schedule starts.
    ``runtime``: the overlap runtime the schedule runs under (:func:`.schedules.forward_backward`; the
    trainer's, which keeps the helper thread and the counters for the run; ``None``: one for the call).
    """
    layout = parallel_state.layout
    pp, vpp = layout.pp, layout.virtual_stages
    if len(chunks) != vpp:
        raise ValueError(f"expected {vpp} model chunks on this rank (parallel.vpp), got {len(chunks)}")
    # a virtual stage may hold no parameter (an empty stage of parallel.pipeline_layout); the rank holds some
    first = next(p for c in chunks for p in c.parameters())
    device, dtype = first.device, first.dtype
    cfg = chunks[0].config
    mbs, seq = microbatches[0]["tokens"].shape
    cp, tp = layout.cp, layout.tp
    shape = (seq // (cp * tp), mbs, cfg.hidden_size)
    sums: List[torch.Tensor] = []
    mtp_sums: List[torch.Tensor] = []

    def step(chunk: int, m: int, inp: Optional[torch.Tensor]) -> torch.Tensor:
        mb = microbatches[m]
        model = chunks[chunk]
        tokens = mb["tokens"].to(device)
        first = m == 0  # TE reuses the FP8 weights for the later micro-batches of the step
        index = mb.get("sample_index")
        index = index.to(device) if index is not None else None  # the dropout masks' sequence coordinate
        if not model.post_process:
            return model.stage_forward(tokens, hidden_SBH=inp, first_microbatch=first, sample_index=index)
        lm_BS, mtp_BS = model.stage_forward(
            tokens,
            hidden_SBH=inp,
            sample_index=index,
            labels=mb["labels"].to(device),
            loss_mask=mb["loss_mask"].to(device),
            first_microbatch=first,
            loss_parts=True,
        )
        loss_sum = lm_BS.float().sum()
        sums.append(loss_sum.detach().double())
        if mtp_BS is not None:
            mtp_sum = mtp_BS.float().sum()
            mtp_sums.append(mtp_sum.detach().double())
            loss_sum = loss_sum + cfg.mtp_loss_scaling_factor * mtp_sum
        return loss_sum * loss_scale

    p2p = None
    if pp > 1:
        p2p = P2P(
            pp_group=parallel_state.groups.pp,
            pp_ranks=parallel_state.coords.pp.ranks,
            pp_rank=parallel_state.coords.pp.rank,
        )
    last = len(microbatches) - 1

    def grad_sync(chunk: int, m: int):
        return contextlib.nullcontext() if m == last else no_sync()

    with step_scope(chunks, training=not forward_only):
        forward_backward(
            forward_step=step,
            num_microbatches=len(microbatches),
            pp_size=pp,
            pp_rank=parallel_state.coords.pp.rank,
            vpp=vpp,
            p2p=p2p,
            tensor_shape=shape,
            dtype=dtype,
            device=device,
            forward_only=forward_only,
            backward_context=grad_sync if no_sync is not None else None,
            overlap=overlap,
            runtime=runtime,
        )

    def total(parts):
        return torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64, device=device)

    return {"lm_loss_sum": total(sums), "mtp_loss_sum": total(mtp_sums)}
