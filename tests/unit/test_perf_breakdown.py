"""The benchmark's profiler breakdown charges forward and backward work to the labelled parts."""

import time

import torch

from benchmarks import breakdown as bd


class Heavy(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(n, n) / n**0.5)

    def forward(self, x):
        return x @ self.w


def test_backward_is_charged_to_the_part_whose_forward_made_it():
    torch.manual_seed(0)
    big, small = Heavy(384), Heavy(16)
    proj = torch.nn.Linear(384, 16, bias=False)
    lab = bd.Labeller()
    assert lab.modules(big, {"experts": (Heavy,)}) == 1
    assert lab.modules(small, {"router": (Heavy,)}) == 1
    x = torch.randn(512, 384)
    with torch.profiler.profile() as prof:
        t0 = time.perf_counter()
        for _ in range(3):
            y = big(big(x))  # two forward ranges, four large backward matmuls
            small(proj(y)).sum().backward()
        wall = time.perf_counter() - t0
    nodes = {}
    parts = bd.breakdown(prof, wall, backward_nodes=nodes)
    assert set(parts) == set(bd.CATEGORIES) | {"other"}
    # per step: two matmul nodes made inside `big`, one inside `small`; proj's and sum's are nobody's
    assert nodes == {"experts": 6, "router": 3}
    fwd = sum(e.cpu_time_total for e in prof.events() if e.name == "part:experts") * 1e-6
    assert parts["experts"] > fwd > 0  # the backward is added to the forward range
    assert sum(parts.values()) <= wall * 1.05
    kinds = bd.op_classes(prof, wall)
    assert kinds["gemm"] > 0 and kinds["optimizer"] == 0.0
