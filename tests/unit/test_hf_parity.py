"""Parity with transformers' MixtralForCausalLM / Qwen2MoeForCausalLM / Qwen3MoeForCausalLM / OlmoeForCausalLM
at 1 rank (fp32): logits, LM loss and every parameter gradient; HF -> engine -> HF round trip; clear errors
for bad checkpoints."""

import json
import os

import pytest
import torch

from tests.optional import require

transformers = require("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from folding.model.hf.weights import CheckpointError, from_hf, to_hf  # noqa: E402
from folding.moe.settings import LayerSettings  # noqa: E402
from tests.hf_checks import TINY_HF, assert_matches_hf, randomized  # noqa: E402
from tests.unit.test_model_reference_moe import reference_moe_factory  # noqa: E402

V, S, B = TINY_HF["vocab_size"], 12, 2


def tiny_hf(kind, **kw):
    """A random tiny HF model (weights ~N(0, 0.1) so that routing and attention are not trivial)."""
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(**TINY_HF, num_key_value_heads=2, num_experts_per_tok=2)
    if kind == "mixtral":
        cfg = MixtralConfig(**common, intermediate_size=16, num_local_experts=4, **kw)
        model = MixtralForCausalLM(cfg)
    elif kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, intermediate_size=24, moe_intermediate_size=8, num_experts=4, **kw)
        model = Qwen3MoeForCausalLM(cfg)
    elif kind == "olmoe":
        cfg = OlmoeConfig(**common, intermediate_size=8, num_experts=4, eos_token_id=None, pad_token_id=None, **kw)
        model = OlmoeForCausalLM(cfg)
    else:
        cfg = Qwen2MoeConfig(
            **common,
            intermediate_size=24,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=16,
            num_experts=4,
            **kw,
        )
        model = Qwen2MoeForCausalLM(cfg)
    return randomized(model).eval()


def save(model, path, legacy_rope=False):
    model.save_pretrained(path)
    if legacy_rope:  # rewrite config.json with transformers 4's top-level rope_theta spelling
        f = os.path.join(path, "config.json")
        c = json.load(open(f))
        c["rope_theta"] = c.pop("rope_parameters")["rope_theta"]
        json.dump(c, open(f, "w"))
    return path


CASES = [
    ("mixtral", dict(rope_theta=5e4), False),
    ("mixtral", dict(tie_word_embeddings=True, rope_theta=2e5), True),
    ("qwen2_moe", dict(norm_topk_prob=False, mlp_only_layers=[0], rope_theta=3e4), False),
    ("qwen2_moe", dict(norm_topk_prob=True, decoder_sparse_step=2, tie_word_embeddings=True, rope_theta=7e3), True),
    ("qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=[1], head_dim=12, rope_theta=3e4), False),
    ("qwen3_moe", dict(norm_topk_prob=False, decoder_sparse_step=2, tie_word_embeddings=True, rope_theta=7e3), True),
    ("olmoe", dict(norm_topk_prob=False, rope_theta=5e4), False),
    ("olmoe", dict(norm_topk_prob=True, tie_word_embeddings=True, rope_theta=2e4), True),
]
CASE_IDS = [
    "mixtral",
    "mixtral-tied-legacyrope",
    "qwen2-pattern",
    "qwen2-norm-tied-legacyrope",
    "qwen3-headdim-pattern",
    "qwen3-tied-legacyrope",
    "olmoe",
    "olmoe-norm-tied-legacyrope",
]


def check_parity(tmp_dir, family, kw, legacy, moe_factory=reference_moe_factory):
    """Convert a tiny HF model of ``family`` and check the engine model against it
    (:func:`tests.hf_checks.assert_matches_hf`); return the logits' relative error."""
    hf = tiny_hf(family, **kw)
    path = save(hf, os.path.join(str(tmp_dir), "ckpt"), legacy)
    # transformers adds no load-balancing loss without output_router_logits, which save_pretrained writes
    # false; the engine's coefficient (router_aux_loss_coef) is zeroed to compare the LM loss and its
    # gradients (tests/distributed/test_aux_loss_grad_hf.py compares the aux loss's)
    model = from_hf(path, moe_factory=moe_factory, config_overrides={"moe": {"aux_loss_coeff": 0.0}})
    assert model.config.rope_theta == kw["rope_theta"]
    assert model.config.tie_embeddings == kw.get("tie_word_embeddings", False)
    assert [model.config.is_moe_layer(i) for i in range(3)] == [
        type(l.mlp).__name__.endswith("MoeBlock") for l in hf.model.layers
    ]
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    return assert_matches_hf(model, hf, ids, family)


@pytest.mark.parametrize("family,kw,legacy", CASES, ids=CASE_IDS)
def test_logits_loss_grads_match_transformers(tmp_path, family, kw, legacy):
    check_parity(tmp_path, family, kw, legacy)


@pytest.mark.parametrize("family,kw,legacy", CASES, ids=CASE_IDS)
def test_parity_with_engine_moe_layer(tmp_path, family, kw, legacy):
    """The same checks with the engine's MoE layer (default factory, no process group): the logits'
    relative error stays below 1e-4 (what the checks of :func:`check_parity` hold it to)."""
    err = check_parity(tmp_path, family, kw, legacy, moe_factory=None)
    assert err < 1e-4, (family, err)


@pytest.mark.parametrize(
    "family,kw",
    [
        ("qwen2_moe", dict(mlp_only_layers=[1], tie_word_embeddings=False)),
        ("qwen3_moe", dict(mlp_only_layers=[1], head_dim=12, norm_topk_prob=True)),
        ("olmoe", dict(norm_topk_prob=True)),
    ],
)
def test_round_trip_bit_identical(tmp_path, family, kw):
    hf = tiny_hf(family, **kw)
    path = save(hf, str(tmp_path / "a"))
    model = from_hf(path, moe_factory=reference_moe_factory)
    to_hf(model, str(tmp_path / "b"))
    a, b = load_file(os.path.join(path, "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # and transformers loads the export back
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "b"))
    ids = torch.randint(0, V, (1, 8))
    torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=0, atol=0)


def test_bad_checkpoints_fail_clearly(tmp_path):
    hf = tiny_hf("mixtral")
    path = save(hf, str(tmp_path / "c"))
    cfg = json.load(open(os.path.join(path, "config.json")))
    # another architecture
    json.dump(dict(cfg, model_type="llama"), open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="model_type='llama'"):
        from_hf(path, moe_factory=reference_moe_factory)
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    # wrong shape
    sd = load_file(os.path.join(path, "model.safetensors"))
    sd["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(8, 32)
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"q_proj.weight.*shape \(8, 32\).*\(32, 32\)"):
        from_hf(path, moe_factory=reference_moe_factory)
    # missing tensor
    del sd["model.layers.1.self_attn.q_proj.weight"]
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing.*layers.1.self_attn.q_proj"):
        from_hf(path, moe_factory=reference_moe_factory)
    # missing shard file named by the index
    os.remove(os.path.join(path, "model.safetensors"))
    json.dump(
        {"weight_map": {k: "model-00002-of-00002.safetensors" for k in sd}},
        open(os.path.join(path, "model.safetensors.index.json"), "w"),
    )
    with pytest.raises(CheckpointError, match="missing shard files.*00002"):
        from_hf(path, moe_factory=reference_moe_factory)
    # unsupported rope type
    json.dump(
        dict(cfg, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
        open(os.path.join(path, "config.json"), "w"),
    )
    with pytest.raises(CheckpointError, match="rope_type='yarn'"):
        from_hf(path, moe_factory=reference_moe_factory)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_generated_config_round_trip(tmp_path, family):
    """A model exported without its source config.json (one generated from ModelConfig) loads in
    transformers with the same logits, and imports back to the same ModelConfig."""
    from transformers import AutoModelForCausalLM

    from folding.model.presets import get_preset
    from folding.model.transformer import MoETransformer

    model = MoETransformer(
        get_preset(f"{family}_tiny"), settings=LayerSettings(init_seed=3), moe_factory=reference_moe_factory
    )
    to_hf(model, str(tmp_path / "g"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "g")).eval()
    assert type(hf).__name__ == {"qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}[family]
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    ref = hf(ids).logits
    with torch.no_grad():
        rel = ((model(ids) - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-5, rel
    back = from_hf(str(tmp_path / "g"), moe_factory=reference_moe_factory).config
    assert back.replace(name=model.config.name) == model.config


def test_qwen3_olmoe_unsupported_fields_fail_clearly(tmp_path):
    path = save(tiny_hf("olmoe"), str(tmp_path / "o"))
    f = os.path.join(path, "config.json")
    cfg = json.load(open(f))
    for change, match in (
        (dict(clip_qkv=8.0), "clip_qkv=8.0"),
        (dict(attention_bias=True), "attention_bias=true"),
        (dict(head_dim=16), "head_dim=16 differs"),
    ):
        json.dump(dict(cfg, **change), open(f, "w"))
        with pytest.raises(CheckpointError, match=match):
            from_hf(path, moe_factory=reference_moe_factory)
    from folding.model.hf.config import config_to_hf
    from folding.model.presets import get_preset

    with pytest.raises(CheckpointError, match="qk_norm='head', not 'none'"):
        config_to_hf(get_preset("qwen3_moe_tiny").replace(qk_norm="none"))
    with pytest.raises(CheckpointError, match="MoE block in every layer"):
        config_to_hf(get_preset("olmoe_tiny").replace(mlp_only_layers=(0,), ffn_hidden_size=64))
    with pytest.raises(ValueError, match="model.qk_norm='rms': choose one of"):
        get_preset("olmoe_tiny").replace(qk_norm="rms")


def test_convert_tool(tmp_path, capsys):
    from tools import convert_hf as tool

    hf = tiny_hf("mixtral", tie_word_embeddings=True)
    path = save(hf, str(tmp_path / "hf"))
    fac = ["--moe-factory", "tests.unit.test_model_reference_moe:reference_moe_factory"]
    assert tool.main(["roundtrip", path, str(tmp_path / "rt")] + fac) == 0
    assert "59/59 tensors bit-identical" in capsys.readouterr().out
    # the same through a sharded export (shards and index compared tensor by tensor)
    assert tool.main(["roundtrip", path, str(tmp_path / "rts"), "--max-shard-bytes", "30000"] + fac) == 0
    assert "59/59 tensors bit-identical" in capsys.readouterr().out
    assert os.path.exists(tmp_path / "rts" / "model.safetensors.index.json")
    assert tool.main(["import", path, str(tmp_path / "e.pt")] + fac) == 0
    assert tool.main(["export", str(tmp_path / "e.pt"), str(tmp_path / "out")] + fac) == 0
    a, b = load_file(os.path.join(path, "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    json.dump({"model_type": "gpt2"}, open(os.path.join(path, "config.json"), "w"))
    assert tool.main(["roundtrip", path, str(tmp_path / "rt2")] + fac) == 2
    assert "model_type='gpt2'" in capsys.readouterr().err


def test_multi_file_checkpoint(tmp_path):
    """A checkpoint split over several safetensors files (with an index) loads file by file."""
    hf = tiny_hf("mixtral")
    hf.save_pretrained(str(tmp_path / "s"), max_shard_size="40KB")
    files = [f for f in os.listdir(tmp_path / "s") if f.endswith(".safetensors")]
    assert len(files) > 1 and os.path.exists(tmp_path / "s" / "model.safetensors.index.json")
    model = from_hf(str(tmp_path / "s"), moe_factory=reference_moe_factory)
    ids = torch.randint(0, V, (1, 8))
    torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_sharded_export(tmp_path):
    """Beyond max_shard_bytes the export writes safetensors shards and their index, which both from_hf
    and transformers read back bit for bit; a later single-file export into the same directory drops
    the stale index."""
    import json

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    hf = tiny_hf("qwen3_moe", mlp_only_layers=[1], head_dim=12)
    path = save(hf, str(tmp_path / "a"))
    model = from_hf(path, moe_factory=reference_moe_factory)
    out = tmp_path / "b"
    to_hf(model, str(out), max_shard_bytes=40_000)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    with open(out / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
    assert sorted(set(index["weight_map"].values())) == files
    a = load_file(os.path.join(path, "model.safetensors"))
    assert sorted(index["weight_map"]) == sorted(a)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in a.values())
    for name, fname in index["weight_map"].items():
        with safe_open(str(out / fname), "pt") as f:
            assert torch.equal(f.get_tensor(name), a[name]), name
    for fname in files:  # every shard but one-tensor ones stays within the limit
        with safe_open(str(out / fname), "pt") as f:
            sizes = [f.get_tensor(k).numel() * 4 for k in f.keys()]
        assert len(sizes) == 1 or sum(sizes) <= 40_000, (fname, sizes)
    ids = torch.randint(0, V, (1, 8))
    torch.testing.assert_close(from_hf(str(out), moe_factory=reference_moe_factory)(ids), model(ids), rtol=0, atol=0)
    again = AutoModelForCausalLM.from_pretrained(str(out))
    torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=0, atol=0)
    to_hf(model, str(out))  # fits one file now
    assert os.path.exists(out / "model.safetensors") and not os.path.exists(out / "model.safetensors.index.json")
    with pytest.raises(ValueError, match="max_shard_bytes=0 must be >= 1"):
        to_hf(model, str(tmp_path / "c"), max_shard_bytes=0)


def test_bf16_checkpoint_round_trip(tmp_path):
    """A bf16 checkpoint loaded into the fp32 model and exported as bf16 is bit-identical."""
    hf = tiny_hf("qwen2_moe").to(torch.bfloat16)
    hf.save_pretrained(str(tmp_path / "a"))
    model = from_hf(str(tmp_path / "a"), moe_factory=reference_moe_factory)
    assert next(model.parameters()).dtype == torch.float32
    to_hf(model, str(tmp_path / "b"), dtype=torch.bfloat16)
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in a)


def test_exported_weights_are_readable_like_the_config(tmp_path):
    import stat

    from folding.model.hf.weights import to_hf
    from folding.model.presets import get_preset
    from folding.model.transformer import MoETransformer

    to_hf(MoETransformer(get_preset("mixtral_tiny"), settings=LayerSettings(init_seed=1)), str(tmp_path))
    modes = {n: stat.S_IMODE(os.stat(tmp_path / n).st_mode) for n in ("model.safetensors", "config.json")}
    assert modes["model.safetensors"] == modes["config.json"], modes
