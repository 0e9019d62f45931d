"""Pipeline schedules: no pipelining, 1F1B, and interleaved 1F1B with virtual stages.

A schedule runs ``num_microbatches`` forward and backward passes through this rank's model chunks
and leaves the gradients accumulated in the parameters. It knows nothing about the model: the
caller gives a ``forward_step(chunk, microbatch, input_tensor)`` that runs chunk ``chunk`` of this
rank on micro-batch ``microbatch`` and returns

- on the last virtual stage: the scalar loss of that micro-batch, already scaled as the caller
  wants its gradient (e.g. masked loss sum / global token count), on which ``backward()`` is called;
- elsewhere: the activation tensor of shape ``tensor_shape`` handed to the next virtual stage.

``input_tensor`` is ``None`` on the first virtual stage (the step reads its own micro-batch).

Ordering (Megatron-Core's): with ``V = pp·vpp`` virtual stages, virtual stage ``v`` lives on rank
``v % pp`` as chunk ``v // pp``. 1F1B runs ``pp − rank − 1`` warm-up forwards, then alternates one
forward and one backward, then drains the backwards. Interleaved 1F1B walks the virtual
micro-batches ``k = 0 .. M·vpp − 1`` in groups of ``pp``: forward chunk ``(k mod pp·vpp) // pp``,
backward chunk ``vpp − 1 −`` that; warm-up is ``2·(pp − rank − 1) + (vpp − 1)·pp`` (all forwards
first when ``M == pp``). It needs ``M`` divisible by ``pp``.

Usage::

    losses = forward_backward(forward_step=step, num_microbatches=8, pp_size=ps.layout.pp,
                              pp_rank=ps.pp_rank, vpp=2, p2p=p2p, tensor_shape=(S, B, H),
                              dtype=torch.float32, device=dev)
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Dict, List, Optional, Tuple

import torch

from .p2p import P2P

ForwardStep = Callable[[int, int, Optional[torch.Tensor]], torch.Tensor]


def schedule_order(*, num_microbatches: int, pp_size: int, pp_rank: int, vpp: int) -> List[Tuple[str, int, int]]:
    """The ordered list of ``("F" | "B", chunk, microbatch)`` steps this rank runs (pure function)."""
    M, pp, r = num_microbatches, pp_size, pp_rank
    if M < 1:
        raise ValueError(f"num_microbatches={M} must be >= 1")
    if vpp == 1:
        fwd = [(0, m) for m in range(M)]
        bwd = [(0, m) for m in range(M)]
        warmup = min(pp - r - 1, M)
    else:
        if M % pp:
            raise ValueError(f"interleaved pipelining needs the number of micro-batches ({M}) to be a "
                             f"multiple of parallel.pp={pp}; change train.global_batch_size or "
                             f"train.micro_batch_size, or set parallel.vpp=null")
        group = pp * vpp
        total = M * vpp

        def mb(k):
            return (k // group) * pp + k % pp

        fwd = [((k % group) // pp, mb(k)) for k in range(total)]
        bwd = [(vpp - 1 - (k % group) // pp, mb(k)) for k in range(total)]
        warmup = total if M == pp else min(2 * (pp - r - 1) + (vpp - 1) * pp, total)
    order = [("F",) + fwd[k] for k in range(warmup)]
    for k in range(len(fwd) - warmup):
        order.append(("F",) + fwd[k + warmup])
        order.append(("B",) + bwd[k])
    order += [("B",) + bwd[k] for k in range(len(fwd) - warmup, len(bwd))]
    return order


def forward_backward(*, forward_step: ForwardStep, num_microbatches: int, pp_size: int, pp_rank: int,
                     vpp: int = 1, p2p: Optional[P2P] = None, tensor_shape=None,
                     dtype: torch.dtype = torch.float32, device=None,
                     forward_only: bool = False,
                     backward_context: Optional[Callable[[int, int], ContextManager]] = None) -> List[torch.Tensor]:
    """Run the schedule; return the detached per-micro-batch losses (in micro-batch order) on the
    rank holding the last virtual stage, and ``[]`` elsewhere.

    ``p2p`` and ``tensor_shape`` are required when ``pp_size > 1``. With ``forward_only`` no
    backward runs (evaluation). ``backward_context(chunk, microbatch)``, when given, returns a
    context manager entered around that backward (the optimizer's ``no_sync`` for every micro-batch
    but a chunk's last, so that its gradient reduction starts during that last backward).
    """
    vpp = vpp or 1
    V = pp_size * vpp
    if pp_size > 1 and (p2p is None or tensor_shape is None):
        raise ValueError("pipeline schedules with pp > 1 need p2p= and tensor_shape=")
    stash: Dict[Tuple[int, int], Tuple[Optional[torch.Tensor], torch.Tensor]] = {}
    losses: Dict[int, torch.Tensor] = {}

    def run_forward(chunk: int, m: int) -> None:
        v = chunk * pp_size + pp_rank
        inp = None
        if v > 0:
            inp = p2p.recv_forward(tensor_shape, dtype, vstage=v, microbatch=m, device=device)
            if not forward_only:
                inp.requires_grad_(True)
        with torch.set_grad_enabled(not forward_only):
            out = forward_step(chunk, m, inp)
        if v == V - 1:
            losses[m] = out.detach()
        else:
            p2p.send_forward(out, vstage=v, microbatch=m)
        if not forward_only:
            stash[(chunk, m)] = (inp, out)

    def run_backward(chunk: int, m: int) -> None:
        v = chunk * pp_size + pp_rank
        inp, out = stash.pop((chunk, m))
        if v == V - 1:
            torch.autograd.backward(out)
        else:
            grad = p2p.recv_backward(out.shape, out.dtype, vstage=v, microbatch=m, device=out.device)
            torch.autograd.backward(out, grad)
        if v > 0:
            g = inp.grad if inp.grad is not None else torch.zeros_like(inp)
            p2p.send_backward(g, vstage=v, microbatch=m)

    order = schedule_order(num_microbatches=num_microbatches, pp_size=pp_size, pp_rank=pp_rank, vpp=vpp)
    for kind, chunk, m in order:
        if kind == "F":
            run_forward(chunk, m)
        elif not forward_only:
            with backward_context(chunk, m) if backward_context is not None else contextlib.nullcontext():
                run_backward(chunk, m)
    if p2p is not None:
        p2p.wait_sends()
    return [losses[m] for m in sorted(losses)]
