"""The MoE exchanges hidden by ``parallel.overlap_moe_comm``, and the activations it keeps in flight.

The schedule it models (the engine's, as Megatron-Core's combined 1F1B): in the steady state of every
pipeline schedule the forward of one micro-batch (A) and the backward of another (B) run merged as a
pair, alternating at every MoE exchange, so each exchange of one is in flight while the other computes
its matching piece. Per MoE layer, one exchange = the EP all-to-all plus, with ETP > 1, its ETP
all-gather / reduce-scatter (``exchange_s``):

===============================================  =====================================================
exchange in flight                               compute it hides behind
===============================================  =====================================================
A's forward dispatch                             B's experts backward (dgrad, + wgrad unless delayed) and
                                                 shared-expert backward, and A's own shared-expert forward
A's forward combine                              B's attention backward (its wgrad unless delayed)
B's backward combine (+ recomputed combine)      A's attention + router forward (+ B's attention wgrad
                                                 with ``delay_wgrad``)
B's backward dispatch (+ recomputed dispatch)    A's experts forward (+ B's expert wgrad with
                                                 ``delay_wgrad``: Megatron-Core's ``--delay-wgrad-compute``)
===============================================  =====================================================

Each exchange hides at most the compute it runs beside: what outlasts it stays exposed, and the hidden
part still costs the GPU's ``overlap_contention`` of its time (:func:`~folding.planning.costs.hidden_behind`),
as every other overlapped communication of the model. To pair them each pipeline rank runs a longer
warm-up (:func:`~folding.planning.activations.in_flight_chunks` with ``overlap_moe_comm``: one more chunk
forward when interleaved, ``2(pp - stage - 1) + 1`` micro-batches under 1F1B, 1 without pipelining): those
warm-up forwards and as many backwards of the cool-down are not paired and expose their exchanges, except
the forward dispatch, behind which the micro-batch's own shared expert runs. The longer warm-up keeps more
activations alive (:func:`overlap_activation_bytes`).

Usage::

    unpaired, paired = exposed_exchanges(0.004, pieces, forwards=1, contention=0.3, delay_wgrad=False)
    p = paired_share(pp=8, vpp=1, stage=7, num_microbatches=32)   # 31/32 of the micro-batches paired
    extra = overlap_activation_bytes(cfg, layout, stage=0, seq_length=4096, micro_batch_size=1,
                                     num_microbatches=32)   # cfg: a ModelConfig
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from folding.model.config import ModelConfig

from .activations import in_flight_chunks
from .costs import hidden_behind
from .memory import MemoryEstimate, memory_per_rank


@dataclasses.dataclass(frozen=True)
class MoEPieces:
    """Seconds of the compute pieces of one MoE layer and micro-batch between its exchanges, on one GPU."""

    attention_fwd: float
    """Attention (projections and core) and router forward: what runs before the dispatch."""
    attention_bwd: float
    """Attention and router backward (with the attention's recomputed forward under recompute)."""
    experts_fwd: float
    """The routed experts' grouped GEMMs, forward."""
    experts_dgrad: float
    """The routed experts' data-gradient GEMMs (with their recomputed forward under recompute)."""
    experts_wgrad: float
    """The routed experts' weight-gradient GEMMs."""
    attention_wgrad: float = 0.0
    """The attention projections' weight-gradient GEMMs (part of ``attention_bwd``): with ``delay_wgrad``
    they run behind the backward's next exchange, the combine of the layer below."""
    shared_fwd: float = 0.0
    """The shared expert's forward (0 without one): it runs during its own micro-batch's dispatch."""
    shared_bwd: float = 0.0
    """The shared expert's backward (with its recomputed forward under recompute)."""


def exposed_exchanges(
    exchange_s: float, pieces: MoEPieces, *, forwards: int, contention: float, delay_wgrad: bool = False
) -> Tuple[float, float]:
    """``(unpaired, paired)`` seconds that the exchanges of one MoE layer and micro-batch add to its compute
    with ``overlap_moe_comm``: unpaired in warm-up / cool-down, paired in the steady state (the table in the
    module docstring).

    ``exchange_s``: one exchange (dispatch or combine, either direction); ``forwards``: forwards of the MoE
    sublayer per training pass (2 when recompute re-runs it, which repeats its dispatch and combine inside
    the backward). Without overlap all ``2·(forwards + 1)`` exchanges are exposed; both values are at most
    that.
    """
    total = 2 * (forwards + 1) * exchange_s
    unpaired = total - exchange_s + hidden_behind(exchange_s, pieces.shared_fwd, contention)
    kept_wgrad = 0.0 if delay_wgrad else pieces.experts_wgrad
    moved_attn = pieces.attention_wgrad if delay_wgrad else 0.0
    slots = (
        (exchange_s, pieces.experts_dgrad + kept_wgrad + pieces.shared_bwd + pieces.shared_fwd),
        (exchange_s, pieces.attention_bwd - moved_attn),
        (forwards * exchange_s, pieces.attention_fwd + moved_attn),
        (forwards * exchange_s, pieces.experts_fwd + pieces.experts_wgrad - kept_wgrad),
    )
    paired = sum(hidden_behind(comm, compute, contention) for comm, compute in slots)
    return unpaired, paired


def paired_share(*, pp: int, vpp: int, stage: int, num_microbatches: int) -> float:
    """Fraction of pipeline rank ``stage``'s chunk forwards (and backwards) run paired in the steady state.

    Unpaired are the warm-up forwards of the overlap schedule, one fewer than the rank keeps in flight with
    it (:func:`~folding.planning.activations.in_flight_chunks`), and as many backwards of the cool-down:
    without pipelining the first forward and the last backward of the step, so ``(m - 1)/m``.
    """
    total = num_microbatches * max(vpp, 1)
    warmup = in_flight_chunks(pp=pp, vpp=vpp, stage=stage, overlap_moe_comm=True) - 1  # uncapped
    unpaired = min(warmup, total)
    return (total - unpaired) / total


def overlap_activation_bytes(
    cfg: ModelConfig,
    layout,
    *,
    stage: int,
    seq_length: int,
    micro_batch_size: int,
    num_microbatches: Optional[int] = None,
    recompute: str = "none",
    act_bytes: int = 2,
    fused_swiglu: bool = True,
) -> int:
    """Activation bytes that ``overlap_moe_comm`` adds on pipeline rank ``stage``: the extra chunk forwards
    its longer warm-up keeps (one chunk, ``1/VPP`` of the rank's layers, when interleaved or without
    pipelining; ``pp - stage`` micro-batches under 1F1B), capped by the step's forwards, and on the last
    rank the paired micro-batch's loss input and multi-token-prediction activations
    (:func:`~folding.planning.memory.memory_per_rank` with and without ``overlap_moe_comm``).
    ``cfg``: the :class:`~folding.model.config.ModelConfig`; the other arguments as ``memory_per_rank``'s."""
    kw = dict(
        stage=stage,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        num_microbatches=num_microbatches,
        recompute=recompute,
        act_bytes=act_bytes,
        fused_swiglu=fused_swiglu,
    )
    on = memory_per_rank(cfg, layout, overlap_moe_comm=True, **kw)
    return on.activations - memory_per_rank(cfg, layout, **kw).activations


def memory_with_overlap(cfg: ModelConfig, layout, *, stage: Optional[int] = None, **kw) -> MemoryEstimate:
    """:func:`~folding.planning.memory.memory_per_rank` with ``overlap_moe_comm`` (``stage=None``: the stage
    with the largest total). ``kw``: ``memory_per_rank``'s keywords."""
    return memory_per_rank(cfg, layout, stage=stage, overlap_moe_comm=True, **kw)
