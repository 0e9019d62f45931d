"""Reference points for ``bench_dispatcher_vs_megatron.py --bounds``: the least a dispatcher can do,
one step at a time.

Each bound runs the benchmark's job (forward and backward of dispatch, stand-in expert, combine) on
the same ranks, data and split sizes as the dispatchers, with the split sizes planned ahead and no
bookkeeping: no checks, statistics, wire formats or overlap. Every message is one plain uneven
``all_to_all_single``. Cumulative steps, EP only (no ETP):

- ``bound_move``: permute, rows all-to-all, stand-in expert ``rows·1.5``, all-to-all back,
  unpermute. Only the token movement that any dispatcher makes around an elementwise expert.
- ``bound_sort``: adds the expert-major sort after the exchange and the unsort before the combine.
  One all-to-all delivers the rows rank-major, while a grouped GEMM needs them expert-major.
- ``bound_probs``: adds the router probabilities, permuted, exchanged beside the rows (a second
  all-to-all issued with the first, waited together) and sorted, with the benchmark's stand-in
  ``rows·1.5 + probs``. This is what Megatron-Core's dispatcher interface hands the experts.
- ``bound_counts``: adds the count all-gather and its host read before the permute: a complete
  dropless all-to-all dispatcher, with nothing else.
- ``bound_packed``: ``bound_counts`` with the probabilities in the rows' message, as one more
  column: the permute writes rows and probabilities into one ``[N, H+1]`` send buffer, the sort
  reads both out of the received one, and on the way back the sort's backward writes the row and
  probability gradients into one buffer again and the permute's backward reads them in place. One
  all-to-all each way instead of two, and no packing copy.

Usage (inside a rank of the benchmark)::

    plan = dispatcher.dispatch(x, routing_map, probs)[1].plan   # the split sizes of one call's record
    for name, fn in bound_variants(x, routing_map, probs, grad, group=ep_group, plan=plan):
        fn()
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from folding.moe.dispatch.permute import AllToAllPlan, inverse_order, permute, sort_chunks_by_idxs, unpermute


def _exchange(xs: Sequence[torch.Tensor], group, send: List[int], recv: List[int]) -> List[torch.Tensor]:
    """Uneven ``all_to_all_single`` of every tensor along dim 0, all issued before any is waited on."""
    outs, works = [], []
    for x in xs:
        x = x.contiguous()
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        works.append(dist.all_to_all_single(out, x, list(recv), list(send), group=group, async_op=True))
        outs.append(out)
    for w in works:
        w.wait()
    return outs


class _AllToAll(torch.autograd.Function):
    """Forward: each rank sends ``send[d]`` rows of every tensor to rank ``d`` and receives ``recv[s]``
    rows from rank ``s``. Backward: the reverse exchange of the gradients (``recv`` sent, ``send``
    received)."""

    @staticmethod
    def forward(ctx, group, send, recv, *xs):
        ctx.args = (group, send, recv)
        return tuple(_exchange(xs, group, send, recv))

    @staticmethod
    def backward(ctx, *grads):
        group, send, recv = ctx.args
        return (None, None, None) + tuple(_exchange(grads, group, recv, send))


class _PackedPermute(torch.autograd.Function):
    """Forward: the permuted rows and probabilities written into one ``[N, H+1]`` buffer (returned).
    Backward: the token gradient summed from the buffer's first ``H`` columns (read in place), the
    probabilities' gradient scattered from its last column."""

    @staticmethod
    def forward(ctx, x_TH, probs_TE, token_idx_N, expert_idx_N):
        N, H = token_idx_N.shape[0], x_TH.shape[1]
        buf = x_TH.new_empty(N, H + 1)
        torch.index_select(x_TH, 0, token_idx_N, out=buf[:, :H])
        buf[:, H] = probs_TE[token_idx_N, expert_idx_N]
        ctx.save_for_backward(token_idx_N, expert_idx_N)
        ctx.shapes = (x_TH.shape, probs_TE.shape)
        return buf

    @staticmethod
    def backward(ctx, g_buf):
        token_idx_N, expert_idx_N = ctx.saved_tensors
        (T, H), pshape = ctx.shapes
        # summed at full width: index_add_ reads a strided source several times slower
        gx = g_buf.new_zeros(T, H + 1).index_add_(0, token_idx_N, g_buf)[:, :H]
        gp = g_buf.new_zeros(pshape)
        gp[token_idx_N, expert_idx_N] = g_buf[:, H]
        return gx, gp, None, None


class _UnpackSort(torch.autograd.Function):
    """Forward: the rows and probabilities of a received ``[N, H+1]`` buffer, chunks sorted
    (``sizes`` in ``order``). Backward: both gradients unsorted into one ``[N, H+1]`` buffer."""

    @staticmethod
    def forward(ctx, buf, sizes, order):
        ctx.args = (sizes, order)
        H = buf.shape[1] - 1
        chunks = buf.split(sizes)
        rows = torch.cat([chunks[i][:, :H] for i in order])
        probs = torch.cat([chunks[i][:, H] for i in order])
        return rows, probs

    @staticmethod
    def backward(ctx, g_rows, g_probs):
        sizes, order = ctx.args
        H = g_rows.shape[1]
        out = g_rows.new_empty(g_rows.shape[0], H + 1)
        starts = [0]
        for s in sizes:
            starts.append(starts[-1] + s)
        pos = 0
        for i in order:  # sorted chunk i came from rows [starts[i], starts[i+1]) of the buffer
            n = sizes[i]
            out[starts[i] : starts[i] + n, :H] = g_rows[pos : pos + n]
            out[starts[i] : starts[i] + n, H] = g_probs[pos : pos + n]
            pos += n
        return out, None, None


def bound_variants(
    x: torch.Tensor,
    routing_map: torch.Tensor,
    probs: torch.Tensor,
    grad: torch.Tensor,
    *,
    group,
    plan: AllToAllPlan,
    leaves: Optional[List[Tuple[str, List[torch.Tensor]]]] = None,
) -> List[Tuple[str, Callable[[], None]]]:
    """``[(name, run)]`` for the five bounds of the module docstring. Each ``run()`` does one forward
    and backward of the benchmark's job on fresh leaf copies of ``x`` and ``probs`` (``[T, H]`` and
    ``[T, E]``), with the loss ``(y·grad).sum()``. ``plan`` is this rank's dropless split plan for
    ``routing_map`` over the EP ``group``, taken from a dispatcher that ran the same data. With
    ``leaves`` (a list), each run appends ``(name, [x copy, probs copy])`` (no probs copy for the
    bounds without probabilities), whose ``.grad`` a test can compare with a dispatcher's."""
    T = routing_map.shape[0]
    send, recv, n = list(plan.input_splits), list(plan.output_splits), plan.num_out_tokens
    sizes, order = list(plan.chunk_sizes), list(plan.sort_idxs)
    back_sizes, back_order = [sizes[i] for i in order], inverse_order(order)
    ranks = dist.get_world_size(group)

    def read_counts() -> None:  # every rank's rows per expert, read on the host to plan the splits
        mine = routing_map.sum(0)
        every = mine.new_empty(ranks * mine.numel())
        dist.all_gather_into_tensor(every, mine, group=group)
        every.tolist()

    def run(name: str, sort: bool, with_probs: bool, counts: bool) -> None:
        xx = x.clone().requires_grad_()
        pp = probs.clone().requires_grad_() if with_probs else None
        if leaves is not None:
            leaves.append((name, [xx] + ([pp] if with_probs else [])))
        if counts:
            read_counts()
        rows, rp, idx = permute(xx, routing_map, pp, num_out_tokens=n)
        if with_probs:
            rows, rp = _AllToAll.apply(group, send, recv, rows, rp)
        else:
            (rows,) = _AllToAll.apply(group, send, recv, rows)
        if sort:
            rows = sort_chunks_by_idxs(rows, sizes, order)
            rp = sort_chunks_by_idxs(rp, sizes, order) if with_probs else None
        out = rows * 1.5 + rp.unsqueeze(-1) if with_probs else rows * 1.5
        if sort:
            out = sort_chunks_by_idxs(out, back_sizes, back_order)
        (out,) = _AllToAll.apply(group, recv, send, out)
        y = unpermute(out, idx, num_tokens=T)
        (y * grad).sum().backward()

    flat_N = torch.nonzero_static(routing_map.T.reshape(-1), size=n).squeeze(1)
    token_idx_N, expert_idx_N = flat_N % T, flat_N // T

    def packed() -> None:
        xx, pp = x.clone().requires_grad_(), probs.clone().requires_grad_()
        if leaves is not None:
            leaves.append(("bound_packed", [xx, pp]))
        read_counts()
        (buf,) = _AllToAll.apply(group, send, recv, _PackedPermute.apply(xx, pp, token_idx_N, expert_idx_N))
        rows, rp = _UnpackSort.apply(buf, sizes, order)
        out = sort_chunks_by_idxs(rows * 1.5 + rp.unsqueeze(-1), back_sizes, back_order)
        (out,) = _AllToAll.apply(group, recv, send, out)
        (unpermute(out, token_idx_N, num_tokens=T) * grad).sum().backward()

    return [
        ("bound_move", lambda: run("bound_move", False, False, False)),
        ("bound_sort", lambda: run("bound_sort", True, False, False)),
        ("bound_probs", lambda: run("bound_probs", True, True, False)),
        ("bound_counts", lambda: run("bound_counts", True, True, True)),
        ("bound_packed", packed),
    ]
