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

Every expert backend × FP8 recipe reachable on CPU (``loop``; ``torch`` plain and with ``rowwise`` /
``mxfp8`` through the ``_scaled_grouped_mm`` stand-in; ``emulated`` with each of its recipes; ``te``
plain and with each TE recipe through the TransformerEngine stand-in) keeps the same dropless budget
on EP2 × ETP2, in bf16 for the FP8 recipes, with experts that receive no token: the FP8 kernels' group
offsets are built on the device from the dispatch record's counts (a host list copied there would be
one blocking copy per GEMM), and the delayed recipe's amax histories stay on the device. The stand-ins
run unaudited: they stand for device kernels, whose reads of their offsets happen on the device.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

import folding.moe.experts.select as select_mod
import folding.moe.experts.te as te_mod
from folding.moe.config import MoEConfig
from folding.moe.experts.te import fp8_region
from folding.moe.layer import build_moe_layer
from folding.moe.replicas.table import EMPTY, plan_replicas
from folding.moe.settings import LayerSettings
from folding.parallel import ParallelLayout, build_parallel_state
from folding.quant.emulate import RECIPES as EMULATED_RECIPES
from folding.testing.transfer_audit import TransferAudit
from tests import te_standin
from tests.scaled_grouped_mm_standin import recording_stand_in

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
    return build_moe_layer(
        config=cfg,
        hidden_size=H,
        groups=ps.groups,
        layer_number=1,
        settings=LayerSettings(init_seed=5),
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


# every expert backend x FP8 recipe the CPU stand-ins reach (te through the TransformerEngine stand-in,
# torch FP8 through the _scaled_grouped_mm stand-in); FP8 shapes: H and F/etp multiples of 32 (MXFP8)
FP8_H, FP8_F = 32, 64
BACKEND_RECIPES = (
    [("loop", None), ("torch", None), ("torch", "rowwise"), ("torch", "mxfp8"), ("te", None)]
    + [("emulated", r) for r in EMULATED_RECIPES]
    + [("te", r) for r in ("delayed", "tensorwise", "blockwise", "mxfp8")]
)


def _stand_ins(mp):
    """Install the kernels' CPU stand-ins in this rank (they stand for device kernels: their own host
    reads of sizes happen on the device there, so they run unaudited)."""
    te_standin.install(mp)
    mp.setattr(te_mod, "te_available", lambda: (True, ""))
    mp.setattr(select_mod, "te_available", lambda: (True, ""))
    mp.setattr(select_mod, "scaled_grouped_mm_support", lambda recipe, device, dtype: (True, ""))

    def unaudited(fn):
        def call(*args, **kwargs):
            with torch._C.DisableTorchFunction():
                return fn(*args, **kwargs)

        return call

    mp.setattr(torch, "_scaled_grouped_mm", unaudited(recording_stand_in))
    mp.setattr(te_standin.GroupedLinear, "forward", unaudited(te_standin.GroupedLinear.forward))


def _audit_backends(layout_kw):
    out = []
    lay = ParallelLayout(world_size=dist.get_world_size(), **layout_kw)
    with build_parallel_state(lay) as ps, pytest.MonkeyPatch.context() as mp:
        _stand_ins(mp)
        for backend, recipe in BACKEND_RECIPES:
            cfg = MoEConfig(
                num_experts=E,
                topk=2,
                ffn_hidden_size=FP8_F,
                dispatcher="alltoall",
                expert_backend=backend,
                fp8_recipe=recipe,
                aux_loss_coeff=1e-2,
            )
            dtype = torch.bfloat16 if recipe is not None else torch.float32
            layer = build_moe_layer(
                config=cfg,
                hidden_size=FP8_H,
                groups=ps.groups,
                layer_number=1,
                settings=LayerSettings(init_seed=5, params_dtype=dtype, expert_backend=backend),
            )
            gen = torch.Generator().manual_seed(ps.rank)
            # 8 tokens a rank over 8 experts, top-2: some experts get none (the FP8 padding is exercised)
            x = torch.randn(4, 2, FP8_H, generator=gen).to(dtype).requires_grad_()
            for audited in (False, True):  # warm-up first: first-call work (probes) is not per layer
                with contextlib.ExitStack() as stack:
                    audit = stack.enter_context(TransferAudit()) if audited else None
                    with fp8_region(recipe if backend == "te" else None, amax_reduction_group=ps.groups.dp_cp):
                        y = layer(x)
                    y.float().sum().backward()
            out.append((backend, recipe, audit.h2d, audit.d2h, audit.events))
    return out


def test_budget_every_backend_and_fp8_recipe(ranks):
    results = ranks(4).run(_audit_backends, dict(ep=2, etp=2))
    for rank_out in results:
        assert [(b, r) for b, r, *_ in rank_out] == BACKEND_RECIPES
        over = [(b, r, events) for b, r, h2d, d2h, events in rank_out if h2d or d2h > BUDGET["dropless"]]
        assert not over, over


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
