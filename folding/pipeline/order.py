"""The order of a rank's forward and backward steps under each pipeline schedule (pure).

No pipelining, 1F1B and interleaved 1F1B, in Megatron-Core's order: with ``V = pp·vpp`` virtual
stages, virtual stage ``v`` lives on rank ``v % pp`` as chunk ``v // pp``. 1F1B runs
``pp − rank − 1`` warm-up forwards, then alternates one forward and one backward, then drains the
backwards. Interleaved 1F1B walks the virtual micro-batches ``k = 0 .. M·vpp − 1`` in groups of
``pp``: forward chunk ``(k mod pp·vpp) // pp``, backward chunk ``vpp − 1 −`` that; warm-up is
``2·(pp − rank − 1) + (vpp − 1)·pp``, capped by the ``M·vpp`` forwards (Megatron-Core 0.16's
``get_pp_rank_microbatches``, also when ``M == pp``). It needs ``M``
divisible by ``pp``.

With ``overlap`` (``parallel.overlap_moe_comm``) every schedule runs more forwards in warm-up and
then, in the steady state, each forward merged with the backward that follows it into one *pair*
``("FB", f_chunk, f_microbatch, b_chunk, b_microbatch)``: the two run as the lanes of
:meth:`folding.overlap.runtime.OverlapRuntime.run_pair`, each MoE exchange of one hidden behind the compute of the
other. A pair starts once both of its inputs are present and hands its outputs on only at its end, so
a stage's pair must not need the output of the next stage's pair of the same round, or the stages
would take turns instead of working side by side: the warm-ups of neighbouring stages must differ by
2. Interleaved 1F1B's already do, and it runs one extra warm-up forward (one more chunk of activations
in flight); 1F1B without virtual stages runs ``2·(pp − rank − 1) + 1`` warm-up forwards (twice 1F1B's
``pp − rank`` micro-batches in flight); with no pipelining, one (two micro-batches in flight instead of
one). Forwards and backwards keep their order among themselves, so gradients accumulate in the same
order as without overlap.

Usage::

    schedule_order(num_microbatches=8, pp_size=4, pp_rank=0, vpp=2)   # [("F", 0, 0), ...]
    schedule_order(num_microbatches=8, pp_size=1, pp_rank=0, vpp=1, overlap=True)
    # [("F", 0, 0), ("FB", 0, 1, 0, 0), ("FB", 0, 2, 0, 1), ..., ("B", 0, 7)]
"""

from __future__ import annotations

from typing import List, Tuple


def schedule_order(
    *, num_microbatches: int, pp_size: int, pp_rank: int, vpp: int, overlap: bool = False
) -> List[Tuple]:
    """The ordered list of ``("F" | "B", chunk, microbatch)`` steps this rank runs (pure function);
    with ``overlap``, the steady state's ``("FB", f_chunk, f_microbatch, b_chunk, b_microbatch)`` pairs
    (see the module docstring)."""
    M, pp, r = num_microbatches, pp_size, pp_rank
    if M < 1:
        raise ValueError(f"num_microbatches={M} must be >= 1")
    if vpp == 1:
        fwd = [(0, m) for m in range(M)]
        bwd = [(0, m) for m in range(M)]
        warmup = min(pp - r - 1, M)
    else:
        if M % pp:
            raise ValueError(
                f"interleaved pipelining needs the number of micro-batches ({M}) to be a "
                f"multiple of parallel.pp={pp}; change train.global_batch_size or "
                f"train.micro_batch_size, or set parallel.vpp=null"
            )
        group = pp * vpp
        total = M * vpp

        def mb(k):
            return (k // group) * pp + k % pp

        fwd = [((k % group) // pp, mb(k)) for k in range(total)]
        bwd = [(vpp - 1 - (k % group) // pp, mb(k)) for k in range(total)]
        warmup = min(2 * (pp - r - 1) + (vpp - 1) * pp, total)
    if overlap:
        # a pair finishes its backward only at its end, so a stage's pair must not wait for the next
        # stage's pair of the same round: without virtual stages the stages' warm-ups then differ by 2
        # (as interleaving's already do), else by the one extra forward that starts the pairs
        warmup = min((2 * (pp - r - 1) if vpp == 1 else warmup) + 1, len(fwd))
    order = [("F",) + fwd[k] for k in range(warmup)]
    for k in range(len(fwd) - warmup):
        if overlap:
            order.append(("FB",) + fwd[k + warmup] + bwd[k])
            continue
        order.append(("F",) + fwd[k + warmup])
        order.append(("B",) + bwd[k])
    order += [("B",) + bwd[k] for k in range(len(fwd) - warmup, len(bwd))]
    return order
