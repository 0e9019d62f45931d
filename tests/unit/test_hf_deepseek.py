"""Parity with transformers' DeepseekV3ForCausalLM at 1 rank (fp32): multi-head latent attention (q LoRA
and plain q_proj), YaRN RoPE with both mscales, the sigmoid router with a non-zero correction bias and
group-limited top-k scored by the top-2 of each group, the routed scaling factor, an ungated shared
expert and leading dense layers; logits, loss and every gradient; HF -> engine -> HF bit-exact, the
correction bias included; config round trip; clear errors."""

import json
import os

import pytest
import torch

from tests.optional import require

transformers = require("transformers")
from safetensors.torch import load_file  # noqa: E402

from folding.model.config import ModelConfig  # noqa: E402
from folding.model.hf.config import config_from_hf, config_to_hf  # noqa: E402
from folding.model.hf.weights import CheckpointError, from_hf, to_hf  # noqa: E402
from folding.moe.settings import LayerSettings  # noqa: E402
from tests.hf_checks import TINY_HF, assert_matches_hf, randomized  # noqa: E402

V, S, B = TINY_HF["vocab_size"], 16, 2
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=8,
    beta_fast=32,
    beta_slow=1,
    mscale=0.9,
    mscale_all_dim=0.7,
)


def tiny_hf(**kw):
    """A random tiny DeepSeek-V3 (weights ~N(0, 0.1), correction bias ~N(0, 0.3))."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    args = dict(
        **TINY_HF,
        intermediate_size=48,
        moe_intermediate_size=8,
        num_key_value_heads=4,
        n_shared_experts=2,
        n_routed_experts=8,
        routed_scaling_factor=2.5,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        v_head_dim=12,
        qk_nope_head_dim=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        max_position_embeddings=64,
        rope_parameters=YARN,
    )
    args.update(kw)
    model = randomized(DeepseekV3ForCausalLM(DeepseekV3Config(**args)))
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    return model.eval()


CASES = {
    "qlora-yarn-groups": dict(),
    "qproj-default-rope": dict(q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 5e4}),
    "no-interleave-nogroups-tied": dict(rope_interleave=False, n_group=1, topk_group=1, tie_word_embeddings=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_loss_grads_match_transformers(tmp_path, case):
    hf = tiny_hf(**CASES[case])
    path = str(tmp_path / "ckpt")
    hf.save_pretrained(path)
    model = from_hf(path)
    cfg = model.config
    assert cfg.family == "deepseek_v3" and cfg.mlp_only_layers == (0,) and cfg.moe.expert_bias
    assert (cfg.yarn is not None) == (case != "qproj-default-rope")
    bias = model.layers["1"].mlp.router.expert_bias
    torch.testing.assert_close(bias, hf.model.layers[1].mlp.gate.e_score_correction_bias, rtol=0, atol=0)
    assert bias.abs().max() > 0.1
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    assert_matches_hf(model, hf, ids, "deepseek_v3")


def test_routing_differs_without_the_bias_and_with_megatron_group_score(tmp_path):
    """The test config is sensitive to what it claims to check: dropping the correction bias or
    scoring groups by topk//group_topk (= 1 here) changes the logits."""
    hf = tiny_hf()
    path = str(tmp_path / "ckpt")
    hf.save_pretrained(path)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    ref = from_hf(path)(ids)
    with torch.no_grad():
        no_bias = from_hf(path)
        no_bias.layers["1"].mlp.router.expert_bias.zero_()
        assert (no_bias(ids) - ref).abs().max() > 1e-3
        megatron_rule = from_hf(path, config_overrides={"moe": {"group_score_topk": None}})
        assert megatron_rule.config.moe.num_groups == 4
        assert (megatron_rule(ids) - ref).abs().max() > 1e-3


def test_round_trip_bit_identical(tmp_path):
    hf = tiny_hf()
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    hf.save_pretrained(src)
    to_hf(from_hf(src), dst)
    a, b = load_file(os.path.join(src, "model.safetensors")), load_file(os.path.join(dst, "model.safetensors"))
    assert sorted(a) == sorted(b)
    assert any(k.endswith("e_score_correction_bias") for k in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    # config.json is written back as read: transformers' num_nextn_predict_layers=1 without MTP tensors,
    # which the import builds without MTP
    assert config_from_hf(json.load(open(os.path.join(dst, "config.json")))) == from_hf(src).config.replace(
        name="hf_deepseek_v3", mtp_num_layers=1
    )


def test_generated_config_loads_in_transformers(tmp_path):
    """An engine-built DeepSeek-V3 (random init, non-zero bias) exported with a generated config.json
    is the same function in transformers; the config maps back to itself."""
    from transformers import DeepseekV3ForCausalLM

    from folding.model.presets import get_preset
    from folding.model.transformer import MoETransformer

    cfg = get_preset("deepseek_v3_tiny")
    assert ModelConfig.from_dict(json.loads(json.dumps(__import__("dataclasses").asdict(cfg)))) == cfg
    # the balance loss is training-only: transformers has no field for it
    assert config_from_hf(config_to_hf(cfg), name=cfg.name) == cfg.replace(
        moe={"aux_loss_type": "aux_loss", "aux_loss_coeff": 0.0}
    )
    model = MoETransformer(cfg, settings=LayerSettings(init_seed=3))
    with torch.no_grad():
        for i in range(cfg.num_layers):
            if cfg.is_moe_layer(i):
                model.layers[str(i)].mlp.router.expert_bias.normal_(0, 0.05, generator=torch.Generator().manual_seed(i))
    path = str(tmp_path / "out")
    to_hf(model, path)
    hf = DeepseekV3ForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, got = hf(ids).logits, model(ids)
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-5


def test_bad_deepseek_configs_fail_clearly(tmp_path):
    hf = tiny_hf()
    path = str(tmp_path / "ckpt")
    hf.save_pretrained(path)
    base = json.load(open(os.path.join(path, "config.json")))
    for change, needle in (
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope_type"),
    ):
        with pytest.raises(CheckpointError, match=needle):
            config_from_hf({**base, **change})
    with pytest.raises(CheckpointError, match="group_score_topk"):
        config_to_hf(config_from_hf(base).replace(moe={"group_score_topk": None}))


def test_bf16_checkpoint_round_trip_keeps_the_bias_fp32(tmp_path):
    """A bf16 checkpoint whose correction biases are fp32 (as transformers keeps them) comes back bit
    for bit, dtypes included, through an fp32 engine model exported with ``dtype=torch.bfloat16``."""
    hf = tiny_hf().to(torch.bfloat16)
    for layer in hf.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.data = layer.mlp.gate.e_score_correction_bias.data.float()
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    hf.save_pretrained(src)
    a = load_file(os.path.join(src, "model.safetensors"))
    assert a["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    to_hf(from_hf(src), dst, dtype=torch.bfloat16)
    b = load_file(os.path.join(dst, "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# The released DeepSeek-V3 config.json (transformers-4 spelling: top-level rope_theta, rope_scaling with
# "type"; fields transformers ignores, such as topk_method, moe_layer_freq and num_nextn_predict_layers).
RELEASED = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_released_config_is_the_preset():
    from folding.model.presets import get_preset

    preset = get_preset("deepseek_v3")
    got = config_from_hf(RELEASED, name="deepseek_v3")
    assert got == preset.replace(moe={"aux_loss_type": "aux_loss", "aux_loss_coeff": 0.0})
    assert got.num_parameters() == preset.num_parameters()


def test_checkpoint_without_mtp_tensors_imports_without_mtp(tmp_path):
    """transformers saves DeepSeek-V3 without the MTP layers but keeps num_nextn_predict_layers=1: the
    import warns and builds the model without MTP; an unexpected tensor is still an error."""
    from safetensors.torch import save_file

    hf = tiny_hf()
    path = str(tmp_path / "ckpt")
    hf.save_pretrained(path)
    assert json.load(open(os.path.join(path, "config.json")))["num_nextn_predict_layers"] == 1
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match="no multi-token-prediction tensors"):
        model = from_hf(path)
    assert model.config.mtp_num_layers == 0 and model.mtp is None
    with torch.no_grad():
        assert torch.allclose(model(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    tensors["model.layers.1.self_attn.extra.weight"] = torch.zeros(1)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="unexpected"):
        from_hf(path)


def _mtp_model(depth=2):
    """A random engine DeepSeek-V3 with ``depth`` MTP modules and non-zero correction biases."""
    from folding.model.presets import get_preset
    from folding.model.transformer import MoETransformer

    model = MoETransformer(get_preset("deepseek_v3_tiny", mtp_num_layers=depth), settings=LayerSettings(init_seed=5))
    with torch.no_grad():
        for i, (name, buf) in enumerate(model.named_buffers()):
            if name.endswith("expert_bias"):
                buf.normal_(0, 0.3, generator=torch.Generator().manual_seed(i))
    return model


def test_mtp_round_trip_bit_identical(tmp_path):
    """Export of a model with 2 MTP modules names them as DeepSeek-V3 does (model.layers.{L+k}.*, with
    copies of the embedding and output layer); import -> export gives the same tensors bit for bit."""
    model = _mtp_model()
    L = model.config.num_layers
    a_dir, b_dir = str(tmp_path / "a"), str(tmp_path / "b")
    to_hf(model, a_dir)
    a = load_file(os.path.join(a_dir, "model.safetensors"))
    assert json.load(open(os.path.join(a_dir, "config.json")))["num_nextn_predict_layers"] == 2
    for k in (L, L + 1):
        for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "self_attn.kv_b_proj", "mlp.experts.7.down_proj"):
            assert f"model.layers.{k}.{n}.weight" in a, (k, n)
        assert torch.equal(a[f"model.layers.{k}.embed_tokens.weight"], a["model.embed_tokens.weight"])
        assert torch.equal(a[f"model.layers.{k}.shared_head.head.weight"], a["lm_head.weight"])
        assert a[f"model.layers.{k}.eh_proj.weight"].shape == (64, 128)
    assert torch.equal(a[f"model.layers.{L + 1}.eh_proj.weight"], model.mtp[1].eh_proj.weight)
    assert torch.equal(
        a[f"model.layers.{L}.mlp.gate.e_score_correction_bias"], model.mtp[0].layer.mlp.router.expert_bias
    )
    back = from_hf(a_dir)
    for (n, p), (m, q) in zip(model.named_parameters(), back.named_parameters()):
        assert n == m and torch.equal(p, q), n
    for (n, p), (m, q) in zip(model.named_buffers(), back.named_buffers()):
        assert n == m and (p is None or torch.equal(p, q)), n
    to_hf(back, b_dir)
    b = load_file(os.path.join(b_dir, "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_mtp_checkpoint_errors(tmp_path):
    """A checkpoint with some MTP tensors missing, and MTP outside DeepSeek-V3, fail with the fix."""
    from safetensors.torch import save_file

    from folding.model.presets import get_preset
    from folding.model.transformer import MoETransformer

    path = str(tmp_path / "a")
    to_hf(_mtp_model(depth=1), path)
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    del tensors["model.layers.4.hnorm.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.layers.4.hnorm.weight"):
        from_hf(path)
    qwen = MoETransformer(get_preset("qwen3_moe_tiny", mtp_num_layers=1), settings=LayerSettings(init_seed=0))
    with pytest.raises(CheckpointError, match="mtp_num_layers=0"):
        to_hf(qwen, str(tmp_path / "q"))


def test_sharded_checkpoint_imports(tmp_path):
    """A checkpoint saved in several safetensors shards (model.safetensors.index.json) loads the same."""
    hf = tiny_hf()
    one, many = str(tmp_path / "one"), str(tmp_path / "many")
    hf.save_pretrained(one)
    hf.save_pretrained(many, max_shard_size="40KB")
    index = json.load(open(os.path.join(many, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 2
    a, b = from_hf(one), from_hf(many)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    for (n, p), (_, q) in zip(a.named_buffers(), b.named_buffers()):
        assert p is None or torch.equal(p, q), n
