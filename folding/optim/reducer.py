"""Gradient accumulation into fp32 main grads and bucketed reduction, overlapped with backward.

A :class:`GradReducer` installs a post-accumulate-grad hook on every parameter of its buffers. The
hook adds ``param.grad`` (any dtype) into the fp32 ``param.main_grad`` and frees ``param.grad``. While
gradient sync is enabled (the last micro-batch of a step: see :meth:`GradReducer.no_sync`), a bucket
whose parameters have all arrived is *launched*: its first reduction op starts asynchronously while
backward goes on. Buckets launch in one fixed order (the same on every rank of a group), so ranks can
never pair different buckets' collectives. :meth:`GradReducer.finish` waits for the launched ops, runs
the remaining ops of every bucket, and reduces deferred buckets (tied embeddings, the experts of MoE
layers with replicas) last.

Collectives (all sums): ``all_reduce`` over each pre-group, then over the data-parallel group
``all_reduce`` (forward only: no autograd involved) or, under ZeRO-1, ``reduce_scatter_tensor`` into
this rank's shard.

Usage::

    reducer = GradReducer(buffers, overlap=True)
    with reducer.no_sync():
        loss0.backward()          # earlier micro-batches only accumulate
    loss1.backward()              # last micro-batch: buckets launch from hooks
    reducer.finish()              # every main grad (or shard) now holds the global-batch gradient
"""

from __future__ import annotations

import contextlib
import weakref
from typing import List

import torch
import torch.distributed as dist

from ..parallel.collectives import all_gather_single, reduce_scatter_single
from .grad_buffer import Bucket, GradBuffer


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor, group) -> "dist.Work":
    """Start an all-gather of equal 1-D shards into ``out`` (rank order); returns the work handle.
    ``shard`` may be this rank's own slot of ``out`` (in place, as ZeRO-1 uses it: no staging copy).
    Not autograd-aware (used on parameter storage after the optimizer step)."""
    return all_gather_single(out, shard, group=group, async_op=True)


class GradReducer:
    """Hooks, launch order and completion of the gradient reduction of a set of buffers."""

    def __init__(self, buffers: List[GradBuffer], *, overlap: bool = True):
        """``overlap``: launch buckets from backward hooks (else everything runs in :meth:`finish`)."""
        self.buffers = buffers
        self.overlap = overlap
        self.sync_enabled = True
        self.order: List = sorted(
            ((b.deferred, b.order_key, i, j), buf, b)
            for i, buf in enumerate(buffers)
            for j, b in enumerate(buf.buckets)
        )
        self.order = [(buf, b) for _, buf, b in self.order]
        self._next = 0
        for buf in buffers:
            for p in buf.params:
                p.register_post_accumulate_grad_hook(self._make_hook(buf))

    def _make_hook(self, buf: GradBuffer):
        # The hook lives in the parameter's own hook table, so it holds the reducer and the buffer
        # weakly: strong references would close a cycle (parameter -> hook -> buffer -> parameter)
        # that the collector cannot see through the tensor, keeping the buffers and their process
        # groups alive after the optimizer is dropped.
        reducer_ref, buf_ref = weakref.ref(self), weakref.ref(buf)

        def hook(p: torch.nn.Parameter) -> None:
            reducer, buf = reducer_ref(), buf_ref()
            if reducer is None or buf is None:
                return  # the optimizer is gone: the gradient stays in p.grad
            bucket = buf.bucket_of[id(p)]
            if bucket.launched:
                raise RuntimeError(
                    "a gradient arrived after its bucket was reduced: run every micro-batch but the last "
                    "inside `with optimizer.no_sync():`, or call zero_grad() before the next step"
                )
            p.main_grad.add_(p.grad)
            p.grad = None
            if reducer.sync_enabled and reducer.overlap:
                bucket.ready.add(id(p))
                reducer._launch_ready()

        return hook

    @contextlib.contextmanager
    def no_sync(self):
        """Within this context, backward only accumulates gradients (no bucket launches)."""
        old, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = old

    def _launch_ready(self) -> None:
        while self._next < len(self.order):
            buf, b = self.order[self._next]
            if b.deferred or len(b.ready) < len(b.params):
                return
            self._launch(buf, b)
            self._next += 1

    @staticmethod
    def _ops(buf: GradBuffer, b: Bucket):
        ops = [("all_reduce", g) for g in buf.groups.pre_groups]
        if buf.groups.dp_size > 1:
            ops.append(("reduce_scatter" if buf.shard else "all_reduce", buf.groups.dp_group))
        return ops

    @staticmethod
    def _start(buf: GradBuffer, b: Bucket, op, async_op: bool):
        kind, group = op
        view = buf.main_grad[b.start : b.end]
        if kind == "all_reduce":
            return dist.all_reduce(view, group=group, async_op=async_op), None
        out = torch.empty(b.numel() // buf.groups.dp_size, dtype=view.dtype, device=view.device)
        return reduce_scatter_single(out, view, group=group, async_op=async_op), out

    @staticmethod
    def _complete(buf: GradBuffer, b: Bucket, out) -> None:
        if out is not None:
            lo, hi = buf.shard_range(b)
            buf.main_grad[lo:hi].copy_(out)

    def _launch(self, buf: GradBuffer, b: Bucket) -> None:
        b.launched = True
        ops = self._ops(buf, b)
        if ops:
            work, out = self._start(buf, b, ops[0], async_op=True)
            b.pending = (work, out, 0)

    def finish(self) -> None:
        """Complete every bucket's reduction (launching those not launched yet, in order)."""
        for buf, b in self.order:
            if not b.launched:
                self._launch(buf, b)
            ops = self._ops(buf, b)
            first = 0
            if b.pending is not None:
                work, out, first = b.pending
                work.wait()
                self._complete(buf, b, out)
                first += 1
                b.pending = None
            for op in ops[first:]:
                _, out = self._start(buf, b, op, async_op=False)
                self._complete(buf, b, out)
        self._next = len(self.order)

    def reset(self) -> None:
        """Forget launch state (called by zero_grad): the next backward starts a new step."""
        for _, b in self.order:
            if b.pending is not None:
                b.pending[0].wait()
            b.ready.clear()
            b.launched = False
            b.pending = None
        self._next = 0

    @property
    def done(self) -> bool:
        """True once :meth:`finish` ran for the current step."""
        return self._next == len(self.order) and all(b.launched and b.pending is None for _, b in self.order)
