"""Construction settings reach every layer at construction: LayerSettings, the MoE block factory's
contract, the expert backend decided once, and the model checkpointing what the recompute table says."""

import types

import pytest
import torch

import folding.model.block as block_mod
import folding.model.context_parallel as context_parallel
import folding.moe.layer as moe_layer_mod
from folding.model.chunks import build_stage_chunks
from folding.model.moe_block import check_moe_factory, default_moe_factory
from folding.model.presets import get_preset
from folding.model.recompute import RECOMPUTE, RECOMPUTE_MODES, recompute_mode
from folding.model.transformer import MoETransformer
from folding.moe.experts.grouped import GroupedMLP
from folding.moe.experts.select import resolve_backend
from folding.moe.layer import MoELayer
from folding.moe.settings import LayerSettings
from folding.parallel import ParallelLayout
from folding.parallel.groups import ProcessGroups


def _cfg():
    return get_preset("qwen2_moe_tiny", num_layers=2, mlp_only_layers=(1,))  # layer 0 MoE, layer 1 dense


def test_settings_reach_every_moe_layer_and_its_experts():
    s = LayerSettings(init_seed=4, overlap_comm=True, delay_wgrad=True, recompute="moe", expert_backend="loop")
    model = MoETransformer(_cfg(), settings=s)
    moe = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert len(moe) == 1 and moe[0].overlap_comm and moe[0].experts.delay_wgrad
    assert moe[0].experts.backend == "loop"
    assert all(layer.recompute == RECOMPUTE["moe"] for layer in model.transformer_layers())
    assert model.settings == s
    # parallel.delay_wgrad reaches every dense projection too (Megatron-Core's --delay-wgrad-compute:
    # attention, the shared expert, the dense MLP), except the LM head and the router
    flags = {n: m.delay_wgrad for n, m in model.named_modules() if hasattr(m, "delay_wgrad")}
    for part in ("attention.q_proj", "attention.o_proj", "mlp.shared_expert", "mlp.down_proj"):
        assert any(part in n for n in flags), (part, sorted(flags))
    assert all(flags.values()), flags
    plain = MoETransformer(_cfg(), settings=s.replace(delay_wgrad=False))
    assert not any(getattr(m, "delay_wgrad", False) for m in plain.modules())


def test_a_compiled_attention_keeps_autograd_s_own_weight_gradients():
    s = LayerSettings(overlap_comm=True, delay_wgrad=True, compile_dense=True, expert_backend="loop")
    model = MoETransformer(_cfg(), settings=s)
    for layer in model.transformer_layers():
        assert not any(getattr(m, "delay_wgrad", False) for m in layer.attention.modules())
    assert all(m.experts.delay_wgrad for m in model.modules() if isinstance(m, MoELayer))


def test_build_stage_chunks_hands_the_same_settings_to_every_chunk():
    # one rank without a process group: the layout, its pipeline rank and the single-rank groups
    ps = types.SimpleNamespace(
        layout=ParallelLayout(world_size=1),
        coords=types.SimpleNamespace(pp=types.SimpleNamespace(rank=0)),
        groups=ProcessGroups.single(),
    )
    s = LayerSettings(init_seed=1, overlap_comm=True, recompute="full")
    chunks = build_stage_chunks(model_config=_cfg(), parallel_state=ps, settings=s)
    want = s.replace(expert_backend=resolve_backend("auto", None, torch.device("cpu"), torch.float32))
    assert [c.settings for c in chunks] == [want]  # the backend decided once, for the build
    assert all(m.overlap_comm for c in chunks for m in c.modules() if isinstance(m, MoELayer))
    with pytest.raises(ValueError, match="train.recompute='sometimes'"):
        build_stage_chunks(model_config=_cfg(), parallel_state=None, settings=s.replace(recompute="sometimes"))


def test_a_factory_receives_the_settings_and_one_without_them_is_refused():
    seen = []

    def factory(*, config, layer_number, groups, settings):
        seen.append(settings)
        return default_moe_factory(config=config, layer_number=layer_number, groups=groups, settings=settings)

    s = LayerSettings(overlap_comm=True, delay_wgrad=True, expert_backend="loop")
    MoETransformer(_cfg(), settings=s, moe_factory=factory)
    assert seen == [s]

    def old_factory(*, config, layer_number, groups, init_seed=0, device=None, dtype=torch.float32):
        raise AssertionError("never called")

    with pytest.raises(TypeError, match="does not take the keyword.*settings"):
        MoETransformer(_cfg(), moe_factory=old_factory)
    check_moe_factory(lambda **kw: None)  # **kwargs takes every keyword


def test_the_experts_receive_the_backend_that_runs():
    with pytest.raises(ValueError, match="backend='auto'.*resolved once"):
        GroupedMLP(num_local_experts=2, hidden_size=8, ffn_hidden_size=8, backend="auto")
    with pytest.raises(ValueError, match="expert_backend='auto'"):
        LayerSettings(expert_backend="auto")
    s = LayerSettings(params_dtype=torch.float64, device="meta")
    assert s.with_expert_backend(_cfg().moe).expert_backend == "loop"  # fp64 on CPU: no grouped_mm
    assert s.replace(expert_backend="torch").with_expert_backend(_cfg().moe).expert_backend == "torch"  # kept


@pytest.mark.parametrize("mode", RECOMPUTE_MODES + ("core_attn,mlp", "moe,shared_experts"))
def test_the_model_checkpoints_what_the_recompute_table_says(monkeypatch, mode):
    """Each layer checkpoints the whole layer, its attention core and / or its MLP block (the MoE block
    of an MoE layer, the dense MLP of a dense one) and the shared expert, exactly as
    :mod:`folding.model.recompute` says for an MoE layer (0, with a shared expert) and a dense one (1)."""
    calls = []

    def recording(module, what):
        real = module.checkpoint

        def record(fn, *args, **kwargs):
            calls.append(what)
            return real(fn, *args, **kwargs)

        monkeypatch.setattr(module, "checkpoint", record)

    recording(block_mod, "block")
    recording(context_parallel, "core")
    recording(moe_layer_mod, "shared")
    model = MoETransformer(_cfg(), settings=LayerSettings(init_seed=2, recompute=mode))
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).sum().backward()
    m = recompute_mode(mode)
    want = []
    for moe in (True, False):
        if m.whole_layer:
            want.append("block")  # the layer, once; nothing inside it is checkpointed again
            continue
        want += ["core"] if m.has("core_attn") else []
        if moe and m.has("shared_experts") and not m.has("moe"):
            want.append("shared")
        if m.mlp(moe_layer=moe):  # the whole block: the shared expert inside is not checkpointed again
            want.append("block")
    assert calls == want, (mode, calls)
    assert m.name == mode
