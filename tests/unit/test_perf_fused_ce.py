"""The chunked output-layer + cross-entropy against the unfused math (1 rank; TP is covered by the
model's distributed tests, which now run the fused path)."""

import pytest
import torch
import torch.nn.functional as F

from folding.model.fused_cross_entropy import fused_linear_cross_entropy


@pytest.mark.parametrize("chunk", [1, 5, 7, 13, 64])  # 13, 64: one chunk (softmax kept)
def test_loss_and_grads_match_unfused(chunk):
    g = torch.Generator().manual_seed(chunk)
    x = (torch.randn(13, 8, dtype=torch.float64, generator=g) * 2).requires_grad_()
    w = torch.randn(11, 8, dtype=torch.float64, generator=g).requires_grad_()
    t = torch.randint(0, 11, (13,), generator=g)
    up = torch.rand(13, dtype=torch.float64, generator=g)
    loss = fused_linear_cross_entropy(x, w, t, None, chunk_tokens=chunk)
    (loss * up).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy(x2 @ w2.t(), t, reduction="none")
    (ref * up).sum().backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-6)  # fp32 result
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-6, atol=1e-6)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="targets"):
        fused_linear_cross_entropy(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long), None)
    with pytest.raises(ValueError, match="chunk_tokens"):
        fused_linear_cross_entropy(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3, dtype=torch.long), None, 0)
