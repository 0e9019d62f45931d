"""Dense weight gradients deferred behind the backward's next exchange (``folding.overlap.wgrad``).

``wgrad.linear`` must give bitwise the gradients of ``F.linear`` (the deferred GEMMs are the calls
torch's own backward makes), deliver them by the end of the backward when no exchange runs them, fire
the parameters' gradient hooks once with the gradient, and really defer: while the backward is still
running below the projection, its weight has no gradient yet.
"""

import pytest
import torch
import torch.nn.functional as F

from folding.overlap import wgrad
from folding.overlap.runtime import OverlapRuntime
from folding.parallel.linear import ColumnParallelLinear, RowParallelLinear, sp_column_linears

overlap = OverlapRuntime()
"""The runtime every test of this file runs under (current through the autouse fixture below)."""


@pytest.fixture(autouse=True)
def _current_runtime():
    with overlap.active():
        yield


def _grads(linear, x0, w0, b0, cast=None, transposed_grad=False):
    x = x0.clone().requires_grad_()
    w = w0.clone().requires_grad_()
    b = None if b0 is None else b0.clone().requires_grad_()
    xin = x if cast is None else x.to(cast)
    wc = w if cast is None else w.to(cast)
    bc = b if b is None or cast is None else b.to(cast)
    y = linear(xin, wc, bc)
    out = y.transpose(0, 1) if transposed_grad else y  # its gradient reaches y not contiguous
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(y.dtype)
    (out * g).sum().backward()
    return y.detach(), x.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize(
    "shape, bias, transposed, transposed_grad",
    [
        ((37, 3, 96), False, False, False),
        ((37, 3, 96), True, False, False),
        ((16, 4, 32), True, True, False),
        ((64, 256), False, False, False),
        # a gradient that arrives transposed (attention's heads permuted back): the input gradient must
        # be torch's GEMM on the folded rows, not a batched GEMM on the 3-D gradient
        ((37, 3, 96), False, False, True),
        ((16, 4, 32), True, True, True),
    ],
)
def test_deferred_linear_gives_the_gradients_of_f_linear_bitwise(shape, bias, transposed, transposed_grad):
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(shape, generator=gen)
    if transposed:  # a non-contiguous input (sequence and batch swapped)
        x0 = torch.randn(shape[1], shape[0], shape[2], generator=gen).transpose(0, 1)
    w0 = torch.randn(160, shape[-1], generator=gen)
    b0 = torch.randn(160, generator=gen) if bias else None
    want = _grads(F.linear, x0, w0, b0, transposed_grad=transposed_grad)
    got = _grads(wgrad.linear, x0, w0, b0, transposed_grad=transposed_grad)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)
    assert not overlap.deferred.pending(), "the end-of-backward flush left deferred work behind"


def test_deferred_linear_reaches_a_parameter_through_its_cast():
    gen = torch.Generator().manual_seed(2)
    x0, w0, b0 = (
        torch.randn(8, 2, 32, generator=gen),
        torch.randn(48, 32, generator=gen),
        torch.randn(48, generator=gen),
    )
    want = _grads(F.linear, x0, w0, b0, cast=torch.bfloat16)
    got = _grads(wgrad.linear, x0, w0, b0, cast=torch.bfloat16)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_the_weight_gradient_waits_for_the_flush_and_hooks_fire_once_with_it():
    w = torch.nn.Parameter(torch.randn(12, 8))
    x = torch.randn(5, 8, requires_grad=True)
    seen, during = [], []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(None if p.grad is None else p.grad.clone()))
    h = wgrad.linear(x, w)
    # runs in the backward after the projection's node: its input gradient exists, its weight's does not
    h.register_hook(lambda g: g)
    x.register_hook(lambda g: during.append((w.grad is None, overlap.deferred.pending())))
    (h * h).sum().backward()
    assert during == [(True, 1)], during
    assert len(seen) == 1 and seen[0] is not None and torch.equal(seen[0], w.grad)
    ref = torch.nn.Parameter(w.detach().clone())
    (F.linear(x.detach(), ref) ** 2).sum().backward()
    assert torch.equal(w.grad, ref.grad)


def test_an_input_without_gradient_falls_back_to_autograd():
    w = torch.nn.Parameter(torch.randn(6, 4))
    x = torch.randn(3, 4)  # nothing below needs a gradient: no backward would reach a deferring node
    wgrad.linear(x, w).sum().backward()
    assert w.grad is not None and torch.equal(w.grad, torch.ones(3, 6).t().mm(x))


def test_modules_carry_the_setting_and_fused_linears_must_agree():
    a = ColumnParallelLinear(8, 4, tp_group=None, delay_wgrad=True)
    b = ColumnParallelLinear(8, 4, tp_group=None)
    assert a.delay_wgrad and not b.delay_wgrad
    assert RowParallelLinear(4, 8, tp_group=None, delay_wgrad=True).delay_wgrad
    with pytest.raises(ValueError, match="same delay_wgrad"):
        sp_column_linears(torch.randn(2, 1, 8), (a, b), None)


def test_folded_mm_is_matmul_for_a_weight_that_needs_a_gradient():
    # a gradient that arrives transposed, times a weight: torch.matmul folds the rows into one mm when
    # the weight needs a gradient and batches the product when it does not (a detached weight), which
    # rounds differently on CPU; the deferring paths multiply detached weights through folded_mm
    a = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(4)).transpose(0, 1)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = a.matmul(w.clone().requires_grad_())
        assert not torch.equal(a.matmul(w), want), "matmul no longer depends on requires_grad: folded_mm may go"
        assert torch.equal(wgrad.folded_mm(a, w), want)
        assert torch.equal(wgrad.folded_mm(a[0], w), a[0].mm(w))
