"""Host-transfer budget of one MoE layer forward + backward with the ``torch`` expert backend.

Audited on CPU by :class:`folding.testing.transfer_audit.TransferAudit` (which models what a GPU
would copy): device→host reads D2H ≤ 1 dropless (the all-to-all split sizes) and 0 with
pad-to-capacity; host→device copies H2D = 0 in both, for both dispatchers, on a 1×1 expert
domain and on EP-only and EP×ETP layouts of 4 gloo ranks. The router's aux and z losses are on, so their
reductions are audited too. With hot-expert replicas (``moe.expert_replicas=2``, dropless, a slot
table planned from a skewed load) the same budget holds on the EP layouts: the split onto slots and
the replica weights' fetch add no host transfer once the table is set. The hierarchical dispatcher,
with ``nvlink_domain`` making the 4 ranks 2 nodes of 2 (EP4, and EP2 x ETP2 whose EP groups span both
nodes), reads its one gathered count matrix once per layer, dropless and dropping, and copies nothing
to the device; it refuses pad-to-capacity when the configuration is built.
"""

import pytest
import torch
import torch.distributed as dist

from folding.moe.config import MoEConfig
from folding.moe.layer import MoELayer
from folding.moe.replicas import EMPTY, plan_replicas
from folding.parallel import ParallelLayout, build_parallel_state
from folding.testing.transfer_audit import TransferAudit

H, S, B, E = 16, 8, 2, 8
BUDGET = {"dropless": 1, "pad": 0, "drop": 1}  # D2H per layer forward + backward; H2D is 0 everywhere


def _layer(ps, dispatcher, mode, replicas=0):
    cfg = MoEConfig(
        expert_replicas=replicas,
        num_experts=E,
        topk=2,
        ffn_hidden_size=8,
        dispatcher=dispatcher,
        expert_backend="torch",
        capacity_factor=None if mode == "dropless" else 1.0,
        pad_to_capacity=mode == "pad",
        aux_loss_coeff=1e-2,
        z_loss_coeff=1e-3,
    )
    return MoELayer(
        config=cfg,
        hidden_size=H,
        groups=ps.groups,
        layer_number=1,
        init_seed=5,
    )


def _audit(layouts):
    out = []
    for layout_kw in layouts:
        with build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), **layout_kw)) as ps:
            for dispatcher in ("alltoall", "allgather"):
                for mode in ("dropless", "pad"):
                    layer = _layer(ps, dispatcher, mode)
                    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(ps.rank), requires_grad=True)
                    layer(x).sum().backward()  # warm-up: first-call work (backend probe) is not per layer
                    with TransferAudit() as audit:
                        layer(x).sum().backward()
                    out.append((layout_kw, dispatcher, mode, audit.h2d, audit.d2h, audit.events))
            if layout_kw["ep"] == 1:
                continue
            for dispatcher in ("alltoall", "allgather"):
                layer = _layer(ps, dispatcher, "dropless", replicas=2)
                skew = [float(2 ** (E - e)) for e in range(E)]  # expert 0 hottest: replicas get planned
                layer.set_replica_table(plan_replicas(skew, **layer.replica_geometry()))
                assert any(e != EMPTY for e in layer.replica_table)
                x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(ps.rank), requires_grad=True)
                layer(x).sum().backward()  # warm-up: the table's index tensors are built once per table
                with TransferAudit() as audit:
                    layer(x).sum().backward()
                out.append((layout_kw, dispatcher, "dropless", audit.h2d, audit.d2h, audit.events))
    return out


def _check(results):
    for layout_kw, dispatcher, mode, h2d, d2h, events in results:
        where = (layout_kw, dispatcher, mode, events)
        assert h2d == 0, where
        assert d2h <= BUDGET[mode], where


def test_budget_on_one_expert_rank_ep_and_ep_etp(ranks):
    # ep=1: each rank is its own 1x1 expert domain (the 1-rank path); then EP-only and EP x ETP
    results = ranks(4).run(_audit, [dict(ep=1, etp=1), dict(ep=4, etp=1), dict(ep=2, etp=2)])
    assert sum(len(r) for r in results) == 4 * (3 * 2 * 2 + 2 * 2)  # + replicas on the two EP layouts
    for rank_out in results:
        _check(rank_out)


def _audit_hierarchical(layouts):
    out = []
    for layout_kw in layouts:
        lay = ParallelLayout(world_size=dist.get_world_size(), nvlink_domain=2, **layout_kw)
        with build_parallel_state(lay) as ps:
            for mode in ("dropless", "drop"):
                layer = _layer(ps, "hierarchical", mode)
                assert type(layer.dispatcher).__name__ == "HierarchicalDispatcher"
                x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(ps.rank), requires_grad=True)
                layer(x).sum().backward()  # warm-up, as above
                with TransferAudit() as audit:
                    layer(x).sum().backward()
                out.append((layout_kw, "hierarchical", mode, audit.h2d, audit.d2h, audit.events))
    return out


def test_budget_hierarchical_two_nodes(ranks):
    results = ranks(4).run(_audit_hierarchical, [dict(ep=4, etp=1), dict(ep=2, etp=2)])
    assert sum(len(r) for r in results) == 4 * 2 * 2
    for rank_out in results:
        _check(rank_out)
        assert all(d2h == 1 for *_, d2h, _ in rank_out), rank_out  # the one count read, not zero
    with pytest.raises(ValueError, match="moe.pad_to_capacity"):
        MoEConfig(
            num_experts=E,
            topk=2,
            ffn_hidden_size=8,
            dispatcher="hierarchical",
            capacity_factor=1.0,
            pad_to_capacity=True,
        )
