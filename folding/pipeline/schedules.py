"""Pipeline schedules: no pipelining, 1F1B, and interleaved 1F1B with virtual stages.

A schedule runs ``num_microbatches`` forward and backward passes through this rank's model chunks
and leaves the gradients accumulated in the parameters. It knows nothing about the model: the
caller gives a ``forward_step(chunk, microbatch, input_tensor)`` that runs chunk ``chunk`` of this
rank on micro-batch ``microbatch`` and returns

- on the last virtual stage: the scalar loss of that micro-batch, already scaled as the caller
  wants its gradient (e.g. masked loss sum / global token count), on which ``backward()`` is called;
- elsewhere: the activation tensor of shape ``tensor_shape`` handed to the next virtual stage.

``input_tensor`` is ``None`` on the first virtual stage (the step reads its own micro-batch).

The order of each rank's steps is :func:`.order.schedule_order` (Megatron-Core's 1F1B and
interleaved 1F1B); the messages between stages follow :mod:`.comm_plan`, one grouped exchange per
round, so the same code is safe on NCCL and on gloo. With ``overlap`` (``parallel.overlap_moe_comm``)
the steady state runs each forward merged with a backward as a pair
(:meth:`folding.overlap.runtime.OverlapRuntime.run_pair`): the MoE exchanges of each are hidden behind
the compute of the other, and the losses and gradients are bitwise those without overlap. The schedule
runs under an :class:`~folding.overlap.runtime.OverlapRuntime` (the caller's, or one of its own for the
call), current for the whole call: the layers defer work and wait on exchanges through it.

Usage::

    losses = forward_backward(forward_step=step, num_microbatches=8, pp_size=ps.layout.pp,
                              pp_rank=ps.coords.pp.rank, vpp=2, p2p=p2p, tensor_shape=(S, B, H),
                              dtype=torch.float32, device=dev)
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Dict, List, Optional, Tuple

import torch

from ..overlap.runtime import OverlapRuntime
from .comm_plan import Exchange, Key, Pair, rank_program
from .p2p import P2P

ForwardStep = Callable[[int, int, Optional[torch.Tensor]], torch.Tensor]


def forward_backward(
    *,
    forward_step: ForwardStep,
    num_microbatches: int,
    pp_size: int,
    pp_rank: int,
    vpp: int = 1,
    p2p: Optional[P2P] = None,
    tensor_shape=None,
    dtype: torch.dtype = torch.float32,
    device=None,
    forward_only: bool = False,
    backward_context: Optional[Callable[[int, int], ContextManager]] = None,
    overlap: bool = False,
    runtime: Optional[OverlapRuntime] = None,
) -> List[torch.Tensor]:
    """Run the schedule; return the detached per-micro-batch losses (in micro-batch order) on the
    rank holding the last virtual stage, and ``[]`` elsewhere.

    ``p2p`` and ``tensor_shape`` are required when ``pp_size > 1``; every message (activation or
    gradient) has ``tensor_shape`` and ``dtype``. With ``forward_only`` no backward runs
    (evaluation). ``backward_context(chunk, microbatch)``, when given, returns a context manager
    entered around that backward (the optimizer's ``no_sync`` for every micro-batch but a chunk's
    last, so that its gradient reduction starts during that last backward). ``runtime``: the overlap
    runtime the call runs under (the caller's instruments and counters on it; ``None``: one made for the
    call and closed after it).
    """
    vpp = vpp or 1
    V = pp_size * vpp
    if pp_size > 1 and (p2p is None or tensor_shape is None):
        raise ValueError("pipeline schedules with pp > 1 need p2p= and tensor_shape=")
    stash: Dict[Tuple[int, int], Tuple[Optional[torch.Tensor], torch.Tensor]] = {}
    losses: Dict[int, torch.Tensor] = {}
    inbox: Dict[Key, torch.Tensor] = {}  # received, not yet consumed
    outbox: Dict[Key, torch.Tensor] = {}  # produced, not yet sent

    def run_forward(chunk: int, m: int) -> None:
        v = chunk * pp_size + pp_rank
        inp = None
        if v > 0:
            inp = inbox.pop(("F", v, m))
            if not forward_only:
                inp.requires_grad_(True)
        with torch.set_grad_enabled(not forward_only):
            out = forward_step(chunk, m, inp)
        if v == V - 1:
            losses[m] = out.detach()
        else:
            outbox[("F", v + 1, m)] = out
        if not forward_only:
            stash[(chunk, m)] = (inp, out)

    def run_backward(chunk: int, m: int) -> None:
        v = chunk * pp_size + pp_rank
        inp, out = stash.pop((chunk, m))
        if v == V - 1:
            torch.autograd.backward(out)
        else:
            torch.autograd.backward(out, inbox.pop(("B", v, m)))
        if v > 0:
            outbox[("B", v - 1, m)] = inp.grad if inp.grad is not None else torch.zeros_like(inp)

    def backward_step(chunk: int, m: int) -> None:
        with backward_context(chunk, m) if backward_context is not None else contextlib.nullcontext():
            run_backward(chunk, m)
            runtime.flush_deferred()  # delayed weight gradients no exchange has run yet, inside the context

    program = rank_program(
        num_microbatches=num_microbatches,
        pp=pp_size,
        vpp=vpp,
        pp_rank=pp_rank,
        forward_only=forward_only,
        overlap=overlap,
    )
    with contextlib.ExitStack() as stack:
        if runtime is None:
            runtime = stack.enter_context(OverlapRuntime())  # closed (its helper thread ended) after the call
        stack.enter_context(runtime.active())
        for action in program:
            if isinstance(action, Exchange):
                got = p2p.exchange(
                    sends=[(off, outbox.pop(key)) for off, key in action.sends],
                    recvs=[(off, tensor_shape, dtype, device) for off, _ in action.recvs],
                )
                inbox.update((key, t) for (_, key), t in zip(action.recvs, got))
            elif isinstance(action, Pair):
                f, b = action.forward, action.backward
                # the backward starts: on a stage without the loss its first exchange (the last layer's combine)
                # comes before any compute, and it then hides behind the forward's first piece, while the
                # forward's last exchange hides behind the backward's last piece (the first layer's attention)
                with runtime.steady_state():
                    runtime.run_pair(
                        lambda: backward_step(b.chunk, b.microbatch), lambda: run_forward(f.chunk, f.microbatch)
                    )
            elif action.kind == "F":
                run_forward(action.chunk, action.microbatch)
            else:
                backward_step(action.chunk, action.microbatch)
    return [losses[m] for m in sorted(losses)]
