"""The MoE layer on folded layouts of 1, 2, 4 and 8 gloo ranks equals the 1-rank layer.

Global tokens ``X [DP, S, B, H]``: DP ranks hold different micro-batches, and inside a micro-batch the
attention TP×CP ranks hold contiguous chunks of S in tp-cp order (what sequence/context parallel
attention leaves behind). The 1-rank reference runs the same layer (same seeds, layout-independent
init) on whole micro-batches when dropless, and per local chunk when dropping (capacity is decided
from local tokens). Checked, in fp64: the output, the input gradient, the kept (token, expert) pairs,
and every weight gradient after the reduction the optimizer applies (experts: sum over EDP; router
and shared-expert gate: sum over TP×DP×CP; shared-expert shards: sum over DP×CP).
"""

import pytest
import torch
import torch.distributed as dist

from folding.moe.config import MoEConfig
from folding.moe.dispatch import host_sync
from folding.moe.layer import build_moe_layer
from folding.moe.settings import LayerSettings
from folding.parallel import ParallelLayout, build_parallel_state
from folding.parallel.params import param_spec, shard_index

H, S, B, E, FFN, SHARED = 8, 8, 2, 8, 4, 4

# (tp, cp, ep, etp) per world size: EP folded over TP×CP, ETP=2 with EP=2, ETP != TP, EDP > 1
LAYOUTS = {
    1: [(1, 1, 1, 1)],
    2: [(2, 1, 2, 1), (1, 1, 1, 2)],
    4: [(2, 2, 4, 1), (2, 1, 2, 2), (1, 2, 2, 1), (4, 1, 2, 2)],
    8: [(2, 2, 8, 1), (2, 1, 4, 2), (1, 1, 2, 2)],
}
MODES = ("dropless", "drop", "pad")


def _config(c):
    return MoEConfig(
        num_experts=E,
        topk=2,
        ffn_hidden_size=FFN,
        router_dtype="fp64",
        capacity_factor=None if c["mode"] == "dropless" else 1.0,
        pad_to_capacity=c["mode"] == "pad",
        drop_policy="probs",
        dispatcher=c["kind"],
        expert_backend="loop",
        shared_expert_ffn_hidden_size=SHARED if c["shared"] else None,
        shared_expert_gate=c["shared"],
    )


def _record_routing_maps(layer):
    """A list that receives the routing map (after capacity) of each forward of ``layer``'s router."""
    seen = []
    layer.router.register_forward_hook(lambda module, args, out: seen.append(out.routing_map_TE.detach()))
    return seen


def _layer(c, ps):
    return build_moe_layer(
        config=_config(c),
        hidden_size=H,
        groups=ps.groups,
        layer_number=3,
        settings=LayerSettings(init_seed=11, params_dtype=torch.float64),
        init_std=0.3,
    )


def _inputs(c, dp):
    g = torch.Generator().manual_seed(c["seed"])
    return (
        torch.randn(dp, S, B, H, generator=g, dtype=torch.float64),
        torch.randn(dp, S, B, H, generator=g, dtype=torch.float64),
    )


def _reference(cases):
    """1-rank layer; per micro-batch (dropless) or per attention chunk (dropping)."""
    ps = build_parallel_state(ParallelLayout(world_size=1))
    out = []
    try:
        for c in cases:
            layer = _layer(c, ps)
            seen = _record_routing_maps(layer)
            X, G = _inputs(c, c["dp"])
            X.requires_grad_(True)
            chunks = 1 if c["mode"] == "dropless" else c["tp"] * c["cp"]
            sc = S // chunks
            ys, maps = torch.zeros_like(X), torch.zeros(c["dp"], S, B, E, dtype=torch.bool)
            for d in range(c["dp"]):
                for ch in range(chunks):
                    sl = slice(ch * sc, (ch + 1) * sc)
                    y = layer(X[d, sl])
                    (y * G[d, sl]).sum().backward()
                    ys[d, sl] = y.detach()
                    maps[d, sl] = seen.pop().view(sc, B, E)
            grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
            out.append(dict(y=ys, gx=X.grad, maps=maps, grads=grads))
    finally:
        ps.destroy()
    return out


def _shared_shard(name, full, r, tp):
    fl = SHARED // tp
    if name.endswith("fc1_weight"):
        return torch.cat([full[r * fl : (r + 1) * fl], full[SHARED + r * fl : SHARED + (r + 1) * fl]])
    if name.endswith("fc2_weight"):
        return full[:, r * fl : (r + 1) * fl]
    return full


def _summed(t, group):
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def _distributed(cases, refs):
    world = dist.get_world_size()
    states = {}
    checked = 0
    try:
        for c, ref in zip(cases, refs):
            key = (c["tp"], c["cp"], c["ep"], c["etp"])
            if key not in states:
                states[key] = build_parallel_state(
                    ParallelLayout(world_size=world, tp=c["tp"], cp=c["cp"], ep=c["ep"], etp=c["etp"])
                )
            ps = states[key]
            layer = _layer(c, ps)
            seen = _record_routing_maps(layer)
            X, G = _inputs(c, c["dp"])
            sl_len = S // (c["tp"] * c["cp"])
            sl = slice(ps.coords.tp_cp.rank * sl_len, (ps.coords.tp_cp.rank + 1) * sl_len)
            x = X[ps.coords.dp.rank, sl].clone().requires_grad_(True)
            before = host_sync.count()
            y = layer(x)
            (y * G[ps.coords.dp.rank, sl]).sum().backward()
            tag = f"{c} rank {dist.get_rank()}"
            # the whole layer, forward and backward: one device-to-host read, none when padded
            assert host_sync.count() - before == (0 if c["mode"] == "pad" else 1), tag
            torch.testing.assert_close(y, ref["y"][ps.coords.dp.rank, sl], msg=tag)
            torch.testing.assert_close(x.grad, ref["gx"][ps.coords.dp.rank, sl], msg=tag)
            kept = seen.pop().view(sl_len, B, E)
            assert torch.equal(kept, ref["maps"][ps.coords.dp.rank, sl]), f"kept pairs differ: {tag}"
            for name, p in layer.named_parameters():
                full = ref["grads"][name]
                if name.startswith("experts."):
                    spec = param_spec(p)
                    want = full.reshape(spec.full_shape)[shard_index(spec.full_shape, spec.shards)].reshape(p.shape)
                    got = _summed(p.grad, ps.groups.edp)
                elif name.startswith("shared_expert.") and not name.endswith("gate_weight"):
                    want = _shared_shard(name, full, ps.coords.tp.rank, c["tp"])
                    got = _summed(p.grad, ps.groups.dp_cp)
                else:  # router weight, shared gate: replicated over TP with sequence-parallel partial grads
                    want, got = full, _summed(p.grad, ps.groups.tp_dp_cp)
                torch.testing.assert_close(got, want, msg=f"{name}: {tag}")
            checked += 1
    finally:
        for ps in states.values():
            ps.destroy()
    return checked


def _cases(world):
    out, seed = [], 100
    for tp, cp, ep, etp in LAYOUTS[world]:
        for kind in ("alltoall", "allgather"):
            for mode in MODES:
                seed += 1
                out.append(
                    dict(
                        tp=tp,
                        cp=cp,
                        ep=ep,
                        etp=etp,
                        dp=world // (tp * cp),
                        kind=kind,
                        mode=mode,
                        shared=seed % 2 == 0,
                        seed=seed,
                    )
                )
    return out


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_moe_layer_matches_one_rank(ranks, world):
    cases = _cases(world)
    refs = ranks(1).run(_reference, cases)[0]
    checked = ranks(world).run(_distributed, cases, refs)
    assert checked == [len(cases)] * world


def _bf16_wires():
    """bf16 layer with quantized wires against the same layer with an exact wire (loose check)."""
    world = dist.get_world_size()
    ps = build_parallel_state(ParallelLayout(world_size=world, tp=2, ep=2, etp=2))
    try:
        outs = {}
        for wire in ("none", "mxfp8", "fp8"):
            cfg = MoEConfig(
                num_experts=4,
                topk=2,
                ffn_hidden_size=64,
                dispatch_wire=wire,
                combine_wire=wire,
                grad_wire=wire,
                shared_expert_ffn_hidden_size=32,
            )
            layer = build_moe_layer(
                config=cfg,
                hidden_size=64,
                groups=ps.groups,
                init_std=0.2,
                settings=LayerSettings(params_dtype=torch.bfloat16),
            )
            g = torch.Generator().manual_seed(dist.get_rank())
            x = torch.randn(4, 2, 64, generator=g).to(torch.bfloat16).requires_grad_(True)
            y = layer(x)
            y.float().square().sum().backward()
            outs[wire] = (y.detach().float(), x.grad.float(), layer.experts.fc1_weight.grad.float())
        rel = {}
        for wire in ("mxfp8", "fp8"):
            rel[wire] = [float((a - b).norm() / b.norm()) for a, b in zip(outs[wire], outs["none"])]
            assert all(r < 0.1 for r in rel[wire]), (wire, rel[wire])
            assert all(r > 0 for r in rel[wire][:1]), (wire, rel[wire])
        return rel
    finally:
        ps.destroy()


def test_bf16_layer_with_quantized_wires(ranks):
    rel = ranks(4).run(_bf16_wires)
    assert len(rel) == 4
