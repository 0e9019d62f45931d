"""folding's token dispatchers against Megatron-Core's (0.16.1, on CPU gloo ranks through the stand-ins
of ``tests/megatron_cpu.py``): alone, stage by stage, and set inside Megatron-Core's ``MoELayer``
(local spec, SequentialMLP experts) with and without shared-expert overlap, in three layouts and
three capacity modes. The all-to-all dispatcher must give bitwise the same rows, token counts,
output and gradients; the all-gather one the same within float rounding of its different sum order.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from folding.interop.megatron.stages import MegatronDispatcher
from folding.moe.dispatch.base import TokenDispatcher
from tests.optional import require

require("megatron.core")

E, K, H, F, S, B = 8, 2, 16, 12, 8, 2
LAYOUTS = [dict(tp=1, ep=4, etp=1), dict(tp=1, ep=2, etp=2), dict(tp=2, ep=4, etp=1)]  # the last with SP
MODES = ["dropless", "drop", "pad"]


def _config(lay, mode, dispatcher="alltoall", shared=0, overlap=False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=4,
        ffn_hidden_size=F,
        moe_ffn_hidden_size=F,
        num_moe_experts=E,
        moe_router_topk=K,
        tensor_model_parallel_size=lay["tp"],
        expert_model_parallel_size=lay["ep"],
        expert_tensor_parallel_size=lay["etp"],
        sequence_parallel=lay["tp"] > 1,
        moe_token_dispatcher_type=dispatcher,
        moe_expert_capacity_factor=None if mode == "dropless" else 1.0,
        moe_pad_expert_input_to_capacity=mode == "pad",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_overlap=overlap,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bf16=False,
    )


def _routing(T, mode, gen):
    from folding.moe.routing.functions import apply_capacity, topk_routing

    logits = torch.randn(T, E, generator=gen)
    probs, rmap = topk_routing(logits, topk=K)
    if mode != "dropless":
        probs, rmap = apply_capacity(probs, rmap, topk=K, capacity_factor=1.0, pad_to_capacity=mode == "pad")
    return probs, rmap


def _stages(d, x, rmap, probs, w):
    """The six stages with a differentiable stand-in expert: the final results, and what each stage
    hands the next (``token_dispatch``'s rows and probabilities, ``combine_preprocess``'s rows,
    ``token_combine``'s rows)."""
    d = MegatronDispatcher(d) if isinstance(d, TokenDispatcher) else d  # Megatron-Core's own: as it is
    h, p = d.dispatch_preprocess(x, rmap, probs)
    h, p = d.token_dispatch(h, p)
    handed = [h.detach().clone(), p.detach().clone()]
    rows, tpe, rp = d.dispatch_postprocess(h, p)
    c = d.combine_preprocess(rows * w + rp.unsqueeze(-1))
    handed.append(c.detach().clone())
    c = d.token_combine(c)
    handed.append(c.detach().clone())
    out = d.combine_postprocess(c)
    return (rows, torch.as_tensor(tpe).tolist(), rp, out), handed


def _dispatchers_alone(lay, modes):
    from megatron.core import parallel_state as mps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from folding.moe.dispatch.build import build_dispatcher
    from tests.megatron_cpu import destroy_megatron, init_megatron

    init_megatron(**lay)
    out = []
    try:
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        L = E // lay["ep"]
        first = mps.get_expert_model_parallel_rank() * L
        for mode in modes:
            cfg = _config(lay, mode)
            md = MoEAlltoAllTokenDispatcher(L, list(range(first, first + L)), cfg, pg_collection=pgs)
            kw = dict(
                num_experts=E,
                topk=K,
                ep_group=md.ep_group,
                etp_group=md.tp_group,
                capacity_factor=cfg.moe_expert_capacity_factor,
                pad_to_capacity=cfg.moe_pad_expert_input_to_capacity,
            )
            # ETP next to the EP all-to-all (the default; without ETP one all-to-all per local expert,
            # per_expert_exchange), and at Megatron-Core's stage boundaries
            fd = build_dispatcher("alltoall", per_expert_exchange=True, **kw)
            fd_stages = build_dispatcher("alltoall", megatron_stages=True, **kw)
            gen = torch.Generator().manual_seed(100 + dist.get_rank())
            T = S * B // lay["tp"]
            x0 = torch.randn(T, H, generator=gen)
            probs0, rmap = _routing(T, mode, gen)
            g = torch.randn(T, H, generator=gen)
            res, handed = [], []
            for d in (md, fd, fd_stages):
                x, probs = x0.clone().requires_grad_(), probs0.clone().requires_grad_()
                (rows, tpe, rp, y), between = _stages(d, x, rmap, probs, 1.5)
                (y * g).sum().backward()
                res.append((rows.detach(), tpe, rp.detach(), y.detach(), x.grad, probs.grad))
                handed.append(between)
            names = ("rows", "tokens_per_expert", "probs", "output", "x.grad", "probs.grad")

            def differ(a_res, b_res):
                return [
                    n
                    for n, a, b in zip(names, a_res, b_res)
                    if not (a == b if isinstance(a, list) else torch.equal(a, b))
                ]

            stage_names = ("token_dispatch rows", "token_dispatch probs", "combine_preprocess", "token_combine")
            diff = differ(res[0], res[1]) + [f"megatron_stages {n}" for n in differ(res[0], res[2])]
            diff += [
                f"megatron_stages {n}" for n, a, b in zip(stage_names, handed[0], handed[2]) if not torch.equal(a, b)
            ]
            # the default placement hands on other rows wherever ETP > 1 (ETP next to the EP all-to-all)
            # or, without ETP and pad-to-capacity, with several local experts (rows arrive expert-major,
            # unsorted): the stage check has teeth
            moved = not all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(handed[0], handed[1]))
            out.append((mode, diff, res[1][1], moved))
    finally:
        destroy_megatron()
    return out


@pytest.mark.parametrize("li", range(len(LAYOUTS)))
def test_alltoall_dispatcher_is_bitwise_megatrons(ranks, li):
    for rank_result in ranks(4).run(_dispatchers_alone, LAYOUTS[li], MODES):
        for mode, diff, tpe, moved in rank_result:
            assert diff == [], f"{LAYOUTS[li]} {mode}: differs in {diff}"
            assert sum(tpe) > 0
            lay = LAYOUTS[li]
            assert moved == (lay["etp"] > 1 or (E // lay["ep"] > 1 and mode != "pad")), (lay, mode)


def _layer_swap(lay, cases, nvlink_domain=None):
    """Megatron-Core's MoELayer with its own dispatcher, then with folding's set by replace_dispatcher:
    output and every gradient, per case ``(mode, kind, shared, overlap)``. With ``nvlink_domain``,
    folding's hierarchical dispatcher (the EP group split into nodes of that many ranks) replaces
    Megatron-Core's all-to-all one."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from folding.interop.megatron.replace import replace_dispatcher
    from tests.megatron_cpu import destroy_megatron, init_megatron

    init_megatron(**lay)
    out = []
    split = {}
    try:
        for mode, kind, shared, overlap in cases:
            cfg = _config(lay, mode, dispatcher=kind, shared=shared, overlap=overlap)
            torch.manual_seed(7)
            spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
            layer = MoELayer(cfg, spec.submodules)
            gen = torch.Generator().manual_seed(200 + dist.get_rank())
            x0 = torch.randn(S // lay["tp"], B, H, generator=gen)
            g = torch.randn(S // lay["tp"], B, H, generator=gen)
            res = []
            for swap in (False, True):
                if swap and nvlink_domain:
                    if not split:  # the node and rail groups, built once for every case
                        from folding.parallel import build_node_split_groups

                        ep = layer.token_dispatcher.ep_group
                        split = dict(zip(("node_group", "rail_group"), build_node_split_groups(ep, nvlink_domain)))
                    d = replace_dispatcher(layer, kind="hierarchical", **split)
                    assert type(d.dispatcher).__name__ == "HierarchicalDispatcher"  # inside the adapter
                elif swap:
                    replace_dispatcher(layer)
                layer.zero_grad(set_to_none=True)
                x = x0.clone().requires_grad_()
                y, _ = layer(x)
                (y * g).sum().backward()
                grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
                res.append((y.detach(), x.grad, grads))
            (y0, gx0, g0), (y1, gx1, g1) = res
            if kind == "alltoall" and not nvlink_domain:
                same = lambda a, b: torch.equal(a, b)  # noqa: E731
            else:
                same = lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-6)  # noqa: E731
            diff = [] if same(y0, y1) else ["output"]
            diff += [] if same(gx0, gx1) else ["x.grad"]
            diff += [n for n in g0 if n not in g1 or not same(g0[n], g1[n])]
            scale = float(y0.abs().max())
            out.append(((mode, kind, shared, overlap), diff, sorted(g0) == sorted(g1), scale))
    finally:
        if split:
            dist.barrier()
            for grp in split.values():
                dist.destroy_process_group(grp)
        destroy_megatron()
    return out


CASES = [
    ("dropless", "alltoall", 0, False),
    ("drop", "alltoall", 0, False),
    ("pad", "alltoall", 0, False),
    ("dropless", "alltoall", 32, False),
    ("dropless", "alltoall", 32, True),  # shared-expert overlap: the dispatcher computes the shared expert
    ("drop", "alltoall", 32, True),
    ("dropless", "allgather", 0, False),
]


@pytest.mark.parametrize("li", range(len(LAYOUTS)))
def test_inside_megatron_moe_layer(ranks, li):
    for rank_result in ranks(4).run(_layer_swap, LAYOUTS[li], CASES):
        for case, diff, same_params, scale in rank_result:
            assert same_params and scale > 0, case
            assert diff == [], f"{LAYOUTS[li]} {case}: differs in {diff}"


HIER_CASES = [
    ("dropless", "alltoall", 0, False),
    ("drop", "alltoall", 0, False),
    ("dropless", "alltoall", 32, True),  # shared-expert overlap inside the hierarchical dispatcher's stages
]


@pytest.mark.parametrize("li", [0, 1])
def test_hierarchical_inside_megatron_moe_layer(ranks, li):
    """The hierarchical dispatcher (4 ranks as 2 nodes of 2) in place of Megatron-Core's all-to-all
    one: the same output and gradients within float rounding (it sums each node's rows first)."""
    for rank_result in ranks(4).run(_layer_swap, LAYOUTS[li], HIER_CASES, 2):
        for case, diff, same_params, scale in rank_result:
            assert same_params and scale > 0, case
            assert diff == [], f"{LAYOUTS[li]} {case}: differs in {diff}"


def _unsupported():
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from folding.interop.megatron.replace import replace_dispatcher
    from tests.megatron_cpu import destroy_megatron, init_megatron

    lay = dict(tp=1, ep=4, etp=1)
    init_megatron(**lay)
    try:
        cfg = _config(lay, "dropless")
        layer = MoELayer(cfg, get_moe_module_spec(use_te=False, num_experts=E).submodules)
        cfg.moe_router_padding_for_quantization = True
        try:
            replace_dispatcher(layer)
        except ValueError as e:
            return str(e)
        return "no error"
    finally:
        destroy_megatron()


def test_unsupported_feature_fails_at_replacement(ranks):
    for msg in ranks(4).run(_unsupported):
        assert "moe_router_padding_for_quantization=True" in msg, msg
