"""A grouped GEMM split into several calls (``index_limit``) under ``parallel.delay_wgrad``.

A grouped GEMM whose operands exceed 2^31 elements runs as several calls
(:func:`folding.moe.experts.backends.plan_chunks`). With deferred weight gradients every call used to
deliver its own piece of the weight's gradient, so the gradient reducer's hook fired once per call and
raised "a gradient arrived after its bucket was reduced" on the second; the split path also read the
counts to the host and copied each call's offsets back. Checked here on CPU with a small index limit:

- one delivery per weight per backward, through the real :class:`~folding.optim.reducer.GradReducer`
  (one rank, no collective: its bucket launches on the first delivery), for the ``torch`` backend and
  for the experts (:class:`~folding.moe.experts.grouped.GroupedMLP`, whose default limit is read at
  the call); the gradients bitwise those of the same split without deferral, and those of one call
  within round-off;
- no host read of the counts and no host→device copy per call (:class:`folding.testing.transfer_audit.TransferAudit`).
"""

import contextlib

import pytest
import torch

from folding.moe.experts import backends
from folding.moe.experts.backends import grouped_linear
from folding.moe.experts.grouped import GroupedMLP
from folding.optim.grad_buffer import BufferGroups, GradBuffer
from folding.optim.param_groups import ParamClass
from folding.optim.reducer import GradReducer
from folding.overlap.runtime import OverlapRuntime
from folding.testing.transfer_audit import TransferAudit

pytestmark = pytest.mark.usefixtures("one_thread")

H, O = 8, 12
LIMIT = (max(H, O) + 16) * 6  # at most 6 rows a call
COUNTS = [5, 0, 16]  # 21 rows: 4 calls, expert 2 spans three of them


def _reducer(params):
    """A one-rank reducer over ``params`` (one bucket): its hook raises on a second delivery."""
    cls = ParamClass(expert=True, tp_sharded=True, sequence_parallel=False, embedding_tied=False, decay=True,
                     dtype="float32")  # fmt: skip
    groups = BufferGroups(pre_groups=[], dp_group=None, dp_size=1, dp_rank=0, counts_in_norm=True)
    named = [(f"p{i}", p, i) for i, p in enumerate(params)]
    buf = GradBuffer(cls, named, groups=groups, shard=False, bucket_size=10**9)
    return GradReducer([buf], overlap=True)


def _deliveries(params):
    seen = [0] * len(params)
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _, i=i: seen.__setitem__(i, seen[i] + 1))
    return seen


def _inputs():
    gen = torch.Generator().manual_seed(4)
    return torch.randn(sum(COUNTS), H, generator=gen), torch.randn(3, O, H, generator=gen)


def _split_grads(delay, counts, limit=LIMIT, reduce=True, runtime=True):
    """Forward and backward of one split grouped GEMM: inside an overlap runtime (the delivery deferred to
    the runtime's end-of-backward flush, as no exchange runs) or outside every runtime (the autograd
    engine's end-of-backward callback delivers)."""
    x0, w0 = _inputs()
    x, w = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
    seen = _deliveries([w])
    reducer = _reducer([w]) if reduce else None
    rt = OverlapRuntime() if runtime else None
    with rt.active() if rt is not None else contextlib.nullcontext():
        y = grouped_linear(x, w, counts, "torch", index_limit=limit, delay_wgrad=delay)
        (y * y).sum().backward()  # no exchange ran the deferred work: the end of the backward did
    if rt is not None:
        assert rt.deferred.pending() == 0
        rt.close()
    grad = w.main_grad.clone() if reduce else w.grad
    if reducer is not None:
        reducer.finish()
    return y.detach(), x.grad, grad, seen[0]


@pytest.mark.parametrize("runtime", [True, False], ids=["runtime", "no_runtime"])
@pytest.mark.parametrize("device_counts", [False, True])
def test_a_split_grouped_gemm_delivers_its_deferred_weight_gradient_once(device_counts, runtime):
    counts = torch.tensor(COUNTS) if device_counts else COUNTS
    y, gx, gw, n = _split_grads(True, counts, runtime=runtime)
    assert n == 1, f"the weight gradient arrived {n} times"
    y0, gx0, gw0, n0 = _split_grads(False, counts)
    assert n0 == 1
    assert torch.equal(y, y0) and torch.equal(gx, gx0) and torch.equal(gw, gw0)  # deferral changes no bit
    y1, gx1, gw1, _ = _split_grads(False, counts, limit=backends.INDEX_LIMIT)  # one call
    torch.testing.assert_close(y, y1)
    torch.testing.assert_close(gx, gx1)
    torch.testing.assert_close(gw, gw1)


def test_experts_split_at_the_default_limit_deliver_once(monkeypatch):
    """The experts pass no limit: the module's :data:`~folding.moe.experts.backends.INDEX_LIMIT` is read at
    the call, so a small one splits fc1 and fc2 here as 2^31 elements would on a GPU."""
    calls = []
    real = backends._grouped_mm_fn()

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    def run(delay, limit):
        monkeypatch.setattr(backends, "INDEX_LIMIT", limit)
        m = GroupedMLP(num_local_experts=3, hidden_size=H, ffn_hidden_size=O, backend="torch", init_seed=3,
                       delay_wgrad=delay)  # fmt: skip
        params = [m.fc1_weight, m.fc2_weight]
        seen, reducer = _deliveries(params), _reducer(params)
        x = torch.randn(sum(COUNTS), H, generator=torch.Generator().manual_seed(1), requires_grad=True)
        p = torch.rand(sum(COUNTS), generator=torch.Generator().manual_seed(2))
        calls.clear()
        y = m(x, torch.tensor(COUNTS), p)
        forward_calls = list(calls)
        (y * y).sum().backward()
        reducer.finish()
        return seen, forward_calls, [y.detach(), x.grad] + [q.main_grad.clone() for q in params]

    whole_limit = backends.INDEX_LIMIT
    monkeypatch.setattr(backends, "_grouped_mm_fn", lambda: counting)
    seen, forward_calls, got = run(True, LIMIT)
    assert len(forward_calls) > 2, f"fc1 and fc2 ran as {forward_calls} rows: not split"
    assert seen == [1, 1], f"fc1 and fc2 gradients arrived {seen} times"
    _, _, want = run(False, LIMIT)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    _, one_call, whole = run(False, whole_limit)
    assert len(one_call) == 2
    for a, b in zip(got, whole):
        torch.testing.assert_close(a, b)


def test_a_split_grouped_gemm_reads_no_counts_and_copies_nothing_per_call():
    x0, w0 = _inputs()
    for counts, h2d in ((torch.tensor(COUNTS), 0), (COUNTS, 1)):  # device counts; a list: one copy in all
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with TransferAudit() as audit:
            y = grouped_linear(x, w, counts, "torch", index_limit=LIMIT, delay_wgrad=True)
            (y * y).sum().backward()
        assert (audit.h2d, audit.d2h) == (h2d, 0), audit.events


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_a_split_fp8_gemm_delivers_its_deferred_weight_gradient_once(monkeypatch, recipe):
    """The ``torch`` FP8 path (through the stand-in for ``torch._scaled_grouped_mm`` of
    ``test_experts_torch_fp8.py``): aligned counts in 4 calls, an expert spanning two; one delivery,
    the gradients bitwise those without deferral."""
    from tests.scaled_grouped_mm_standin import recording_stand_in

    monkeypatch.setattr(torch, "_scaled_grouped_mm", recording_stand_in)
    align = 16 if recipe == "rowwise" else 32
    counts = [align, 3 * align, align, 2 * align]
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(sum(counts), 32, generator=gen).to(torch.bfloat16)
    w0 = torch.randn(4, 32, 32, generator=gen).to(torch.bfloat16)
    dy = torch.randn(sum(counts), 32, generator=gen).to(torch.bfloat16)
    limit = 2 * align * (32 + 32)  # two blocks of rows per call
    out = []
    for delay in (False, True):
        x, w = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
        seen, reducer = _deliveries([w]), _reducer([w])
        y = grouped_linear(x, w, counts, "torch", recipe, index_limit=limit, delay_wgrad=delay,
                           device_sizes=torch.tensor(counts))  # fmt: skip
        y.backward(dy)
        assert seen == [1], f"delay_wgrad={delay}: the weight gradient arrived {seen[0]} times"
        out.append((y.detach(), x.grad, w.main_grad.clone()))
        reducer.finish()
    assert all(torch.equal(a, b) for a, b in zip(*out))
