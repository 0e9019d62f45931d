"""The fused SwiGLU-with-probabilities node against the unfused autograd math."""

import pytest
import torch
import torch.nn.functional as F

from folding.moe.experts.swiglu import swiglu_prob


def unfused(h, p):
    f = h.shape[-1] // 2
    return F.silu(h[:, :f]) * h[:, f:] * p.to(h.dtype).unsqueeze(-1)


@pytest.mark.parametrize("n,f", [(7, 5), (0, 4), (33, 16)])
def test_forward_and_backward_match_unfused_fp64(n, f):
    g = torch.Generator().manual_seed(n * 100 + f)
    h = torch.randn(n, 2 * f, dtype=torch.float64, generator=g) * 3
    p = torch.rand(n, dtype=torch.float64, generator=g)
    grad = torch.randn(n, f, dtype=torch.float64, generator=g)
    outs = []
    for fn in (swiglu_prob, unfused):
        hh, pp = h.clone().requires_grad_(), p.clone().requires_grad_()
        y = fn(hh, pp)
        y.backward(grad)
        outs.append((y.detach(), hh.grad, pp.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gradcheck():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    p = torch.rand(6, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu_prob, (h, p))


def test_fp32_probs_with_bf16_rows_and_no_prob_grad():
    g = torch.Generator().manual_seed(4)
    h = torch.randn(9, 12, generator=g).bfloat16().requires_grad_()
    p = torch.rand(9, generator=g)  # fp32 probabilities, no gradient wanted
    y = swiglu_prob(h, p)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, unfused(h.detach(), p))
    y.float().sum().backward()
    h2 = h.detach().clone().requires_grad_()
    unfused(h2, p).float().sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=2e-2, atol=2e-2)


def test_bad_shapes_name_the_argument():
    with pytest.raises(ValueError, match="h_NFl2"):
        swiglu_prob(torch.zeros(3, 5), torch.zeros(3))
    with pytest.raises(ValueError, match="probs_N"):
        swiglu_prob(torch.zeros(3, 4), torch.zeros(2))
