"""The model gives the 1-rank loss, logits and gradients in every folded layout (8 gloo ranks).

Each rank builds the 1-rank model from the same config and seed (its own singleton groups) on the
whole global batch, then the sharded model of each layout on its DP share of the batch (contiguous
samples). Per-token loss sums are divided by the global count of unmasked tokens; gradients are
summed over DP x CP (dense) or EDP (experts), and over TP for sequence-parallel parameters, then
compared with the matching slice of the 1-rank gradient. Parameters must be bit-identical slices
(layout-independent init).
"""

import pytest
import torch
import torch.distributed as dist

from folding.model.presets import get_preset
from folding.model.transformer import MoETransformer
from folding.moe.settings import LayerSettings
from folding.parallel import ParallelLayout, build_parallel_state
from folding.parallel.params import param_spec, require_spec, take_slice
from tests.presets import MIXTRAL, OLMOE, QWEN2_TIED, QWEN3, build, random_batch, variant
from tests.unit.test_model_reference_moe import reference_moe_factory

LAYOUTS = [dict(tp=2, cp=2, ep=8, etp=1), dict(tp=2, ep=4, etp=2), dict(cp=2, ep=4, etp=1), dict(tp=4, ep=2, etp=1)]
# Qwen3: per-head q/k norm, head_dim 16 != hidden/heads, a dense layer; OLMoE: q/k norm over the
# whole projection (TP-sharded weights, sum of squares all-reduced over TP)
CONFIGS = [variant(preset, num_layers=2) for preset in (MIXTRAL, QWEN2_TIED, QWEN3, OLMOE)]
B, S = 4, 16


def _compare_layouts(configs, layouts, engine_moe=False):
    world = dist.get_world_size()
    ids, labels, mask = random_batch(B, S, seed=5, masked=0.25)
    count = mask.sum()
    report = []
    for ckw in configs:
        if engine_moe:  # the engine's MoE layer; per-micro-batch aux losses depend on the DP split
            ckw = variant(ckw, moe=dict(aux_loss_coeff=0.0))
        cfg = build(ckw)
        factory = None if engine_moe else reference_moe_factory
        ps1 = build_parallel_state(ParallelLayout(world_size=world))
        try:
            ref = MoETransformer(cfg, parallel_state=ps1, settings=LayerSettings(init_seed=11), moe_factory=factory)
            ref_logits = ref(ids).detach()
            ref_loss = ref(ids, labels=labels, loss_mask=mask).sum() / count
            ref_loss.backward()
            ref_params = {n: p.detach() for n, p in ref.named_parameters()}
            ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        finally:
            ps1.destroy()
        for lkw in layouts:
            ps = build_parallel_state(ParallelLayout(world_size=world, **lkw))
            try:
                model = MoETransformer(
                    cfg, parallel_state=ps, settings=LayerSettings(init_seed=11), moe_factory=factory
                )
                dp, r = ps.coords.dp.size, ps.coords.dp.rank
                sl = slice(r * B // dp, (r + 1) * B // dp)
                pos = model.local_positions(S)
                logits = model(ids[sl]).detach()
                tp, tr = ps.coords.tp.size, ps.coords.tp.rank
                V = cfg.vocab_size
                want = ref_logits[sl][:, pos, tr * V // tp : (tr + 1) * V // tp]
                torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
                loss = model(ids[sl], labels=labels[sl], loss_mask=mask[sl]).sum() / count
                loss.backward()
                total = loss.detach().clone()
                dist.all_reduce(total, group=ps.groups.dp_cp)
                torch.testing.assert_close(total, ref_loss.detach(), rtol=1e-5, atol=0)
                worst = 0.0
                for name, p in model.named_parameters():
                    spec = require_spec(p, name)  # every parameter, dense and MoE, has its record
                    full_p = ref_params[name].reshape(spec.full_shape)
                    assert torch.equal(p.detach(), take_slice(full_p, spec.shards).reshape(p.shape)), name
                    g = p.grad.clone()
                    tags = param_spec(p)
                    dist.all_reduce(g, group=ps.groups.edp if tags.expert else ps.groups.dp_cp)
                    if tags.sequence_parallel:
                        dist.all_reduce(g, group=ps.groups.tp)
                    want_g = take_slice(ref_grads[name].reshape(spec.full_shape), spec.shards).reshape(p.shape)
                    torch.testing.assert_close(g, want_g, rtol=1e-4, atol=1e-6, msg=f"{lkw} {name}")
                    worst = max(worst, (g - want_g).abs().max().item() / max(want_g.abs().max().item(), 1e-30))
                report.append(
                    (
                        cfg.name,
                        ps.layout.describe(),
                        float(total),
                        ref_loss.item(),
                        worst,
                        len(list(model.parameters())),
                    )
                )
            finally:
                ps.destroy()
    return report


@pytest.mark.parametrize("engine_moe", [False, True], ids=["reference_moe", "engine_moe"])
def test_folded_layouts_match_one_rank(ranks, engine_moe):
    results = ranks(8).run(_compare_layouts, CONFIGS, LAYOUTS, engine_moe)
    assert len(results[0]) == len(CONFIGS) * len(LAYOUTS)
    for name, layout, loss, ref_loss, worst, nparams in results[0]:
        print(f"{name:15s} {layout:45s} loss {loss:.7f} (1 rank {ref_loss:.7f}) worst rel grad err {worst:.2e}")


# DeepSeek-V3 (MLA, YaRN, sigmoid group-limited routing, shared expert, dense first layer) with the
# engine's MoE layer: the reference MoE block routes like Mixtral / Qwen2-MoE only.
DEEPSEEK = dict(name="deepseek_v3_tiny", num_layers=2, vocab_size=256, init_std=0.1, moe=dict())


def test_deepseek_v3_layouts_match_one_rank(ranks):
    """MLA under TP2+SP with CP2 (compressed-KV all-gather), TP4, CP2 alone and EP x ETP: logits, loss
    and every gradient (latent down-projections and norms summed over TP) against one rank."""
    results = ranks(8).run(_compare_layouts, [DEEPSEEK], LAYOUTS, True)
    assert len(results[0]) == len(LAYOUTS)
    for name, layout, loss, ref_loss, worst, nparams in results[0]:
        print(f"{name:17s} {layout:45s} loss {loss:.7f} (1 rank {ref_loss:.7f}) worst rel grad err {worst:.2e}")


HF_LAYOUTS = [dict(tp=2, ep=4, etp=2), dict(tp=2, cp=2, ep=4, etp=1)]


def _load_sharded(path, out_root, ids, hf_logits, layouts):
    from folding.model.hf import weights as hf_mod

    read_counts = []
    original = hf_mod._Reader.read

    def counting_read(self, name, shape, index):
        t = original(self, name, shape, index)
        read_counts[-1] += t.numel()
        return t

    hf_mod._Reader.read = counting_read
    try:
        for i, lkw in enumerate(layouts):
            ps = build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), **lkw))
            try:
                read_counts.append(0)
                model = hf_mod.from_hf(path, parallel_state=ps, moe_factory=reference_moe_factory)
                dp, r = ps.coords.dp.size, ps.coords.dp.rank
                b = ids.shape[0]
                assert b % dp == 0, "every DP rank needs samples"
                sl = slice(r * b // dp, (r + 1) * b // dp)
                V = model.config.vocab_size
                want = hf_logits[sl][
                    :,
                    model.local_positions(ids.shape[1]),
                    ps.coords.tp.rank * V // ps.coords.tp.size : (ps.coords.tp.rank + 1) * V // ps.coords.tp.size,
                ]
                torch.testing.assert_close(model(ids[sl]).detach(), want, rtol=1e-5, atol=1e-5)
                hf_mod.to_hf(model, f"{out_root}/layout{i}")
                dist.barrier()
            finally:
                ps.destroy()
    finally:
        hf_mod._Reader.read = original
    return read_counts


def test_hf_load_sharded_and_round_trip(ranks, tmp_path):
    """Each rank loads only its slices of a HF checkpoint; logits match transformers; export is bit-identical."""
    import os

    from safetensors.torch import load_file

    from tests.unit.test_hf_parity import save, tiny_hf

    hf = tiny_hf("qwen2_moe", mlp_only_layers=[1], rope_theta=2e4)
    path = save(hf, str(tmp_path / "hf"))
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf_logits = hf(ids).logits
    counts = ranks(8).run(_load_sharded, path, str(tmp_path), ids, hf_logits, HF_LAYOUTS)
    full = load_file(os.path.join(path, "model.safetensors"))
    total = sum(t.numel() for t in full.values())
    for per_rank in counts:
        assert all(0 < c < total for c in per_rank), (per_rank, total)  # nobody reads everything
    for i in range(len(HF_LAYOUTS)):
        back = load_file(str(tmp_path / f"layout{i}" / "model.safetensors"))
        assert sorted(back) == sorted(full)
        for k in full:
            assert torch.equal(back[k], full[k]), (HF_LAYOUTS[i], k)
    print("elements read per rank:", counts, "of", total)


def _layout_errors():
    """Each bad layout raises a ValueError naming the setting, before any model collective."""
    world = dist.get_world_size()
    cases = [
        (dict(tp=8, ep=1, etp=1), {}, "model.num_kv_heads=4 is not divisible by parallel.tp=8"),
        (dict(tp=2, ep=1, etp=1), dict(vocab_size=255), "model.vocab_size=255 is not divisible by parallel.tp=2"),
        (
            dict(ep=8, etp=1),
            dict(moe=dict(num_experts=4, topk=2)),
            "moe.num_experts=4 is not divisible by parallel.ep=8",
        ),
        (
            dict(ep=2, etp=4),
            dict(moe=dict(ffn_hidden_size=6)),
            "moe.ffn_hidden_size=6 is not divisible by parallel.etp=4",
        ),
    ]
    seen = []
    for lkw, ckw, msg in cases:
        ps = build_parallel_state(ParallelLayout(world_size=world, **lkw))
        try:
            try:
                MoETransformer(
                    get_preset("mixtral_tiny", num_layers=1, **ckw),
                    parallel_state=ps,
                    moe_factory=reference_moe_factory,
                )
            except ValueError as e:
                assert msg in str(e), (msg, str(e))
                seen.append(msg)
        finally:
            ps.destroy()
    for lkw, seq, msg in (
        (dict(tp=2, cp=2, ep=8, etp=1), 10, "sequence length 10 is not divisible by 2*parallel.cp = 4"),
        (dict(tp=4, ep=2, etp=1), 6, "= 6 is not divisible by parallel.tp=4"),
    ):
        ps = build_parallel_state(ParallelLayout(world_size=world, **lkw))
        try:
            model = MoETransformer(
                get_preset("mixtral_tiny", num_layers=1), parallel_state=ps, moe_factory=reference_moe_factory
            )
            try:
                model(torch.zeros(1, seq, dtype=torch.long))
            except ValueError as e:
                assert msg in str(e), (msg, str(e))
                seen.append(msg)
        finally:
            ps.destroy()
    return seen


def test_bad_layouts_fail_clearly(ranks):
    seen = ranks(8).run(_layout_errors)
    assert all(len(s) == 6 for s in seen), seen


def _engine_moe_parity(path, out_root, ids, hf_logits, layouts):
    from folding.model.hf import weights as hf_mod

    for i, lkw in enumerate(layouts):
        ps = build_parallel_state(ParallelLayout(world_size=dist.get_world_size(), **lkw))
        try:
            model = hf_mod.from_hf(path, parallel_state=ps)  # the default factory: folding.moe MoELayer
            assert any(type(layer.mlp).__name__ == "MoELayer" for layer in model.layers.values())
            dp, r = ps.coords.dp.size, ps.coords.dp.rank
            b = ids.shape[0]
            assert b % dp == 0, "every DP rank needs samples"
            sl = slice(r * b // dp, (r + 1) * b // dp)
            V = model.config.vocab_size
            want = hf_logits[sl][
                :,
                model.local_positions(ids.shape[1]),
                ps.coords.tp.rank * V // ps.coords.tp.size : (ps.coords.tp.rank + 1) * V // ps.coords.tp.size,
            ]
            got = model(ids[sl]).detach()
            rel = ((got - want).abs().max() / want.abs().max()).item()
            assert rel <= 1e-5, (lkw, rel)
            hf_mod.to_hf(model, f"{out_root}/engine{i}")
            dist.barrier()
        finally:
            ps.destroy()


def test_hf_parity_with_engine_moe_layer(ranks, tmp_path):
    """from_hf with the engine's own MoE layer (all-to-all dispatcher) matches transformers in folded
    layouts, for Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE (per-head q/k norm, head_dim != hidden/heads),
    OLMoE (q/k norm over the TP-sharded projection) and DeepSeek-V3 (MLA, correction bias), and exports
    bit-identically."""
    import os

    from safetensors.torch import load_file

    from tests.unit.test_hf_deepseek import tiny_hf as tiny_deepseek
    from tests.unit.test_hf_parity import save, tiny_hf

    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(4))
    layouts = [dict(tp=2, cp=2, ep=4, etp=1), dict(tp=2, ep=2, etp=2)]
    families = (
        ("mixtral", {}),
        ("qwen2_moe", dict(mlp_only_layers=[1], norm_topk_prob=True)),
        ("qwen3_moe", dict(mlp_only_layers=[1], head_dim=12, norm_topk_prob=True)),
        ("olmoe", dict(norm_topk_prob=False)),
        ("deepseek_v3", {}),
    )
    for family, kw in families:
        # DeepSeek-V3: MLA with q LoRA, YaRN, non-zero correction bias, 4 groups, dense first layer
        hf = tiny_deepseek() if family == "deepseek_v3" else tiny_hf(family, **kw)
        path = save(hf, str(tmp_path / family))
        with torch.no_grad():
            hf_logits = hf(ids).logits
        ranks(8).run(_engine_moe_parity, path, str(tmp_path / f"{family}_out"), ids, hf_logits, layouts)
        full = load_file(os.path.join(path, "model.safetensors"))
        for i in range(len(layouts)):
            back = load_file(str(tmp_path / f"{family}_out" / f"engine{i}" / "model.safetensors"))
            assert sorted(back) == sorted(full) and all(torch.equal(back[k], full[k]) for k in full)
