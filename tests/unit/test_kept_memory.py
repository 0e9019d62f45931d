"""What one layer of every family keeps for backward, measured, against the memory model, term by term.

The census (:class:`folding.testing.kept_memory.KeptCensus`) lists every storage a layer's forward
creates and leaves alive, by the module that made it; the graph walk
(:func:`folding.testing.kept_memory.saved_by_node`) lists what each autograd node keeps. Both in bf16 and
fp32, on one layer of Mixtral, Qwen2-MoE (shared expert with gate), Qwen3-MoE (per-head q/k norm),
OLMoE (q/k norm over the whole projection) and DeepSeek-V3 (MLA, its dense first layer, the MTP module):

- every term of :func:`folding.planning.activations.activation_terms` is within 10% of the bytes the
  census attributes to it (plus 1 KiB for per-layer constants such as the router's counts);
- no node keeps a copy of values another node keeps (an fp32 copy of a bf16 input: the norms and the
  router once did), and a bf16 layer keeps fp32 tensors only as per-token statistics and router scores,
  each named by node if not;
- each recompute module saves what the model says it saves (within 10%) and leaves the layer's output
  and every gradient bitwise unchanged.

Megatron-Core's ``MoELayer`` on the same shape is compared in
``tests/distributed/test_kept_memory_megatron.py`` (it needs a process group).
"""

from types import SimpleNamespace

import pytest
import torch

from folding.model.presets import get_preset
from folding.model.transformer import MoETransformer
from folding.moe.settings import LayerSettings
from folding.planning.activations import (
    TERMS,
    activation_terms,
    logits_bytes,
    mtp_activation_bytes,
    offloaded_bytes_per_layer,
    rope_bytes,
)
from folding.testing.kept_memory import bytes_by, cast_copies, layer_census, layer_term, loss_census, saved_by_node

pytestmark = pytest.mark.usefixtures("one_thread")

T = 256  # tokens of the micro-batch (one sequence)
ONE_RANK = SimpleNamespace(tp=1, cp=1, etp=1)
SLACK = 1024  # bytes per term that do not scale with tokens (router counts, expert offsets)
FAMILIES = {  # preset -> layers to measure (DeepSeek-V3's first is dense)
    "mixtral_tiny": ("1",),
    "qwen2_moe_tiny": ("1",),
    "qwen3_moe_tiny": ("1",),
    "olmoe_tiny": ("1",),
    "deepseek_v3_tiny": ("0", "1"),
}


def _config(preset: str, moe=None):
    if preset.startswith("deepseek"):
        return get_preset(preset, num_layers=2, **({"moe": moe} if moe else {}))
    moe = {"ffn_hidden_size": 64, "aux_loss_coeff": 0.01, **(moe or {})}
    return get_preset(preset, num_layers=2, hidden_size=128, moe=moe)


def _run_layer(preset, layer_name, dtype, recompute="none", *, grads=False, offload="", moe=None):
    """``(layer, model, census entries, saved-by-node entries or None, (output, grads) or None)``; ``moe``:
    MoE options over the preset's."""
    cfg = _config(preset, moe)
    settings = LayerSettings(init_seed=1, params_dtype=dtype, recompute=recompute, offload_modules=offload)
    model = MoETransformer(cfg, settings=settings)
    layer = model.layers[layer_name]
    x0 = torch.randn(T, 1, cfg.hidden_size, dtype=dtype, generator=torch.Generator().manual_seed(3))
    rope = model.rope(T, dtype=dtype)
    kept, y, x = layer_census(layer, x0, rope, offloader=model.offloader)
    plain = recompute == "none" and not offload
    saved = saved_by_node(y, exclude=[*rope[:2], *model.parameters()]) if plain else None
    out = None
    if grads:
        g = torch.randn(y.shape, dtype=dtype, generator=torch.Generator().manual_seed(4))
        y.backward(g)
        out = (y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters() if p.grad is not None})
    return layer, cfg, kept, saved, out


def _model_terms(cfg, layer, dtype, recompute="none", offload=""):
    return activation_terms(
        cfg,
        ONE_RANK,
        seq_length=T,
        micro_batch_size=1,
        recompute=recompute,
        act_bytes=dtype.itemsize,
        moe_layer=layer.is_moe,
        device="cpu",
        offload=offload,
    )


def _check_terms(measured: dict, model: dict, what: str):
    for term in TERMS:
        got, want = measured.get(term, 0), model[term]
        assert abs(got - want) <= 0.1 * got + SLACK, (
            f"{what}: term {term!r} model {want} B, measured {got} B ({want / T:.1f} vs {got / T:.1f} B/token)"
        )
    assert not set(measured) - set(TERMS), f"{what}: storages outside every term: {set(measured) - set(TERMS)}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("preset", list(FAMILIES))
def test_layer_keeps_what_the_model_says(preset, dtype):
    for name in FAMILIES[preset]:
        layer, cfg, kept, saved, _ = _run_layer(preset, name, dtype)
        what = f"{preset} layer {name} {dtype}"
        measured = bytes_by(kept, lambda k: layer_term(k.module, layer.is_moe))
        _check_terms(measured, _model_terms(cfg, layer, dtype), what)
        # the graph walk sees the same bytes, but for the census's per-layer constants that no node saves
        # (the router's counts) and scalar constants made before the forward that a node saves (MLA: 8 B)
        walked, census = sum(s.nbytes for s in saved), sum(measured.values())
        assert census - SLACK <= walked <= census + 64, f"{what}: nodes keep {walked} B, the census finds {census} B"
        copies = [f"{a.describe()} copies {b.describe()}" for a, b in cast_copies(saved)]
        assert not copies, f"{what}: a second copy of the same values is kept: {copies}"
        if dtype == torch.bfloat16:  # fp32 only for per-token statistics and router scores
            per_token = max(cfg.moe.num_experts, cfg.num_attention_heads) + 1
            wide = [s.describe() for s in saved if s.tensor.dtype == torch.float32 and s.tensor.numel() > per_token * T]
            assert not wide, f"{what}: fp32 tensors wider than a per-token statistic are kept: {wide}"


FP8_CASES = {  # FP8 experts on the emulated backend: moe.fp8_recipe, moe.fp8_act_input_store
    "mxfp8": ("mxfp8", False),
    "mxfp8-act-store": ("mxfp8", True),
    "blockwise-act-store": ("blockwise", True),
    "rowwise": ("rowwise", False),
    "delayed-act-store": ("delayed", True),
}


@pytest.mark.parametrize("case", list(FP8_CASES))
def test_fp8_experts_keep_what_the_model_says(case):
    """Under ``moe.fp8_recipe`` the experts keep each GEMM's input as FP8 codes and scales (and, with
    ``moe.fp8_act_input_store``, fc1's output): the model's dispatch and experts terms follow, in bf16."""
    recipe, store = FP8_CASES[case]
    moe = {"expert_backend": "emulated", "fp8_recipe": recipe, "fp8_act_input_store": store}
    layer, cfg, kept, saved, _ = _run_layer("qwen2_moe_tiny", "1", torch.bfloat16, moe=moe)
    measured = bytes_by(kept, lambda k: layer_term(k.module, layer.is_moe))
    _check_terms(measured, _model_terms(cfg, layer, torch.bfloat16), f"qwen2_moe_tiny {case}")
    codes = sum(s.nbytes for s in saved if s.tensor.dtype == torch.float8_e4m3fn)
    r, h, f = T * cfg.moe.topk, cfg.hidden_size, cfg.moe.ffn_hidden_size
    assert codes == r * (h + f + (2 * f if store else 0))  # 1 byte an element: fc1's and fc2's inputs (fc1's output)
    # against the same layer in bf16, each of those elements went from 2 bytes to 1, less the scales
    saving = sum(k.nbytes for k in _run_layer("qwen2_moe_tiny", "1", torch.bfloat16)[2]) - sum(measured.values())
    assert 0.9 * codes < saving <= codes, (case, saving, codes)


MODULE_CASES = {  # recompute module -> (preset, layer) where it applies
    "core_attn": ("qwen3_moe_tiny", "1"),
    "layernorm": ("mixtral_tiny", "1"),
    "moe_act": ("qwen2_moe_tiny", "1"),
    "mla_up_proj": ("deepseek_v3_tiny", "1"),
    "mlp": ("deepseek_v3_tiny", "0"),
    "moe": ("qwen2_moe_tiny", "1"),
    "shared_experts": ("qwen2_moe_tiny", "1"),
    "full": ("olmoe_tiny", "1"),
    "selective,moe_act": ("deepseek_v3_tiny", "1"),
}


@pytest.mark.parametrize("module", list(MODULE_CASES))
def test_recompute_module_saves_what_the_model_says_and_changes_no_bit(module):
    preset, name = MODULE_CASES[module]
    dtype = torch.bfloat16
    layer0, cfg, kept0, _, (y0, gx0, g0) = _run_layer(preset, name, dtype, grads=True)
    layer, _, kept, _, (y, gx, g) = _run_layer(preset, name, dtype, module, grads=True)
    saved_measured = sum(k.nbytes for k in kept0) - sum(k.nbytes for k in kept)
    saved_model = sum(_model_terms(cfg, layer0, dtype).values()) - sum(_model_terms(cfg, layer, dtype, module).values())
    assert saved_measured > 0, f"{module} kept as much as no recompute ({saved_measured} B saved)"
    assert abs(saved_model - saved_measured) <= 0.1 * saved_measured + SLACK, (
        f"{module} on {preset}: the model saves {saved_model} B, measured {saved_measured} B"
    )
    measured = bytes_by(kept, lambda k: layer_term(k.module, layer.is_moe))
    _check_terms(measured, _model_terms(cfg, layer, dtype, module), f"{preset} {module}")
    assert torch.equal(y, y0) and torch.equal(gx, gx0), module
    assert g.keys() == g0.keys() and all(torch.equal(g[k], g0[k]) for k in g0), module


@pytest.mark.parametrize("preset", ["mixtral_tiny", "deepseek_v3_tiny"])
def test_last_stage_forward_keeps_its_layers_head_and_mtp(preset):
    """The whole model on one rank, loss included: embedding, layers, final norm, fused loss and (DeepSeek-V3)
    the MTP module keep the sum of their terms."""
    dtype = torch.bfloat16
    cfg = _config(preset).replace(num_layers=1)
    model = MoETransformer(cfg, settings=LayerSettings(init_seed=1, params_dtype=dtype))
    measured = loss_census(model, T)
    kw = dict(seq_length=T, micro_batch_size=1, act_bytes=2, device="cpu")
    layers = sum(sum(activation_terms(cfg, ONE_RANK, moe_layer=cfg.is_moe_layer(i), **kw).values()) for i in range(1))
    # one chunk of logits: its softmax is kept (T <= model.loss_chunk_tokens), half the model's peak figure
    head = logits_bytes(cfg, ONE_RANK, seq_length=T, micro_batch_size=1, act_bytes=2, chunk_tokens=T)
    head -= 4 * T * cfg.vocab_size
    mtp = mtp_activation_bytes(cfg, ONE_RANK, seq_length=T, micro_batch_size=1, act_bytes=2, device="cpu")
    rope = rope_bytes(cfg, ONE_RANK, seq_length=T, act_bytes=2)
    want = layers + head + mtp + rope + 8 * T  # and the embedding's int64 ids
    assert T <= model.loss_chunk_tokens
    assert abs(measured - want) <= 0.1 * measured + 4 * SLACK, (preset, measured / T, want / T)


OFFLOAD_CASES = {  # offload modules -> (preset, layer) where they move something off the device
    "attn_norm": ("mixtral_tiny", "1"),
    "qkv_linear": ("qwen3_moe_tiny", "1"),
    "core_attn": ("qwen3_moe_tiny", "1"),
    "core_attn,attn_proj": ("olmoe_tiny", "1"),  # GQA: the kernel's output is the projection's input
    "attn_proj": ("deepseek_v3_tiny", "1"),  # MLA on CPU: the projection keeps a copy of its own
    "mlp_norm": ("qwen2_moe_tiny", "1"),
    "expert_fc1": ("mixtral_tiny", "1"),
    "moe_act": ("deepseek_v3_tiny", "1"),
    "qkv_linear,core_attn": ("deepseek_v3_tiny", "1"),
}


@pytest.mark.parametrize("offload", list(OFFLOAD_CASES))
def test_offload_module_moves_what_the_model_says_and_changes_no_bit(offload):
    """What an offload module's regions save leaves the device for the host tier (a separate storage on
    CPU, counted apart): the device's terms and the host bytes as the model says, within 10%; the output
    and every gradient bitwise those of the run without offloading."""
    preset, name = OFFLOAD_CASES[offload]
    dtype = torch.bfloat16
    layer0, cfg, kept0, _, (y0, gx0, g0) = _run_layer(preset, name, dtype, grads=True)
    layer, _, kept, _, (y, gx, g) = _run_layer(preset, name, dtype, grads=True, offload=offload)
    device = [k for k in kept if k.tier == "device"]
    host = sum(k.nbytes for k in kept if k.tier == "host")
    measured = bytes_by(device, lambda k: layer_term(k.module, layer.is_moe))
    _check_terms(measured, _model_terms(cfg, layer, dtype, offload=offload), f"{preset} offload {offload}")
    moved = sum(k.nbytes for k in kept0) - sum(k.nbytes for k in device)
    assert moved > 0, f"{offload}: nothing left the device"
    want_host = offloaded_bytes_per_layer(
        cfg,
        ONE_RANK,
        seq_length=T,
        micro_batch_size=1,
        offload=offload,
        act_bytes=2,
        moe_layer=layer.is_moe,
        device="cpu",
    )
    assert abs(host - want_host) <= 0.1 * host + SLACK, f"{offload}: host tier {host} B, the model says {want_host} B"
    assert torch.equal(y, y0) and torch.equal(gx, gx0), offload
    assert g.keys() == g0.keys() and all(torch.equal(g[k], g0[k]) for k in g0), offload
