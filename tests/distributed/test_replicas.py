"""Hot-expert replicas compute exactly what the plain MoE layer computes, on 4 gloo ranks.

The same layer (same seeds, fp64) runs once without replicas and once with ``moe.expert_replicas``
and a slot table planned from a skewed load, on the same tokens: the output and the input gradient
are equal, and every weight gradient (the owners' now summed with their replicas') agrees to fp64
round-off. Covered: both dispatchers, dropless and dropping, EP4 and EP2×ETP2, an FP8 dispatch wire.
The test also checks that it is not vacuous: replica slots received rows, and the fetched replica
weights are their owners' weights.
"""

import pytest
import torch
import torch.distributed as dist

from folding.moe.config import MoEConfig
from folding.moe.layer import build_moe_layer
from folding.moe.replicas.fetch import fetch_replica_weights
from folding.moe.replicas.table import plan_replicas
from folding.moe.settings import LayerSettings
from folding.parallel import ParallelLayout, build_parallel_state

H, T, E = 16, 24, 8
# a skewed load: experts 0 and 1 (both on EP rank 0) are hot
LOAD = [60, 40, 6, 5, 4, 3, 2, 1]
CASES = [  # (ep, etp, dispatcher, capacity_factor, backend, dispatch_wire, replicas)
    (4, 1, "alltoall", None, "torch", "none", 2),
    (4, 1, "alltoall", 1.0, "loop", "none", 1),
    (2, 2, "alltoall", None, "loop", "none", 2),
    (4, 1, "allgather", None, "loop", "none", 1),
    (4, 1, "alltoall", None, "loop", "fp8", 2),
]


def _fp64(case):
    """fp64 where the backend and wire allow it (torch's CPU grouped_mm and the FP8 wire are fp32)."""
    return case[4] != "torch" and case[5] == "none"


def _layer(case, ps, replicas):
    ep, etp, kind, cf, backend, wire, _ = case
    cfg = MoEConfig(
        num_experts=E,
        topk=2,
        ffn_hidden_size=8,
        router_dtype="fp64",
        capacity_factor=cf,
        dispatcher=kind,
        expert_backend=backend,
        dispatch_wire=wire,
        expert_replicas=replicas,
    )
    return build_moe_layer(
        config=cfg,
        hidden_size=H,
        groups=ps.groups,
        layer_number=1,
        settings=LayerSettings(init_seed=5, params_dtype=torch.float64 if _fp64(case) else torch.float32),
        init_std=0.3,
    )


def _run(case, ps, replicas):
    layer = _layer(case, ps, replicas)
    if replicas:
        layer.set_replica_table(plan_replicas(LOAD, **layer.replica_geometry()))
    seen = []
    layer.experts.register_forward_hook(lambda m, args, out: seen.append(list(args[1].tokens_per_expert_host)))
    dtype = layer.experts.fc1_weight.dtype
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    x = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_(True)
    w = torch.randn(T, H, generator=g, dtype=torch.float64).to(dtype)
    y = layer(x)
    (y * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return layer, y.detach(), x.grad.clone(), grads, seen[0]


def _check(cases):
    world = dist.get_world_size()
    out = []
    for case in cases:
        ps = build_parallel_state(ParallelLayout(world_size=world, ep=case[0], etp=case[1]))
        try:
            _, y0, gx0, g0, _ = _run(case, ps, 0)
            layer, y1, gx1, g1, counts = _run(case, ps, case[-1])
            tol = dict(rtol=1e-12, atol=1e-12) if _fp64(case) else dict(rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(y1, y0, **tol, msg=str(case))
            torch.testing.assert_close(gx1, gx0, **tol, msg=str(case))
            assert sorted(g0) == sorted(g1)
            for n in g0:
                torch.testing.assert_close(g1[n], g0[n], **tol, msg=f"{case} {n}")
            L = layer.experts.num_local_experts
            replica_rows = sum(counts[L:])
            rows = torch.tensor([replica_rows], dtype=torch.long)
            dist.all_reduce(rows)
            # the fetched replica weights are the owners' weights
            table, R = layer.replica_table, layer.num_replicas
            r = layer.dispatcher.ep_rank
            got = fetch_replica_weights(
                layer.experts.fc1_weight, table, ep_group=ps.groups.ep, ep_size=case[0], ep_rank=r, num_replicas=R
            ).detach()
            full = [torch.empty_like(layer.experts.fc1_weight) for _ in range(case[0])]
            dist.all_gather(full, layer.experts.fc1_weight.detach().contiguous(), group=ps.groups.ep)
            full = torch.cat(full)
            for j, e in enumerate(table[r * R : (r + 1) * R]):
                assert torch.equal(got[j], full[e] if e >= 0 else torch.zeros_like(got[j])), (case, j, e)
            out.append((table, int(rows)))
        finally:
            ps.destroy()
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"ep{c[0]}etp{c[1]}-{c[2]}-cf{c[3]}-{c[4]}-{c[5]}-r{c[6]}")
def test_replicas_compute_like_the_plain_layer(ranks, case):
    results = ranks(4).run(_check, [case])
    table, rows = results[0][0]
    assert all(res[0] == (table, rows) for res in results), results  # the same table and totals everywhere
    assert any(e >= 0 for e in table), table
    assert rows > 0, "no row reached a replica slot: the test would be vacuous"
