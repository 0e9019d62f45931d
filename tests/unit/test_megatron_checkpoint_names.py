"""Megatron-Core checkpoint names onto the engine's, on a tiny torch_dist store written directly with DCP.

The store holds what Megatron-Core 0.16 writes for a 1-layer MoE GPT (tensors stacked over the layers,
experts stacked in ``mlp.experts.experts.*``): the fused QKV of 2 query groups of 1 head each is
``[q0; k0; v0; q1; k1; v1]`` (4 rows each), so ``q_proj`` is rows 0-3 and 12-15, ``k_proj`` rows 4-7 and
16-19, ``v_proj`` rows 8-11 and 20-23. A key the conversion does not understand is refused by name before
anything is written; ``checkpoint.init_from_megatron`` fills a model with the same tensors the tool writes,
and is refused before any process group when it is not a torch_dist checkpoint or fights another start.
"""

import os
import warnings

import pytest
import torch

from folding.checkpoint.from_megatron import check_init_megatron, convert_megatron, load_megatron_weights
from folding.checkpoint.load import load_model
from folding.job.config import CheckpointConfig, ConfigError, JobConfig
from folding.model.hf.errors import CheckpointError
from folding.model.presets import get_preset
from folding.model.transformer import MoETransformer

H, HEADS, GROUPS, D, E, F, V = 8, 2, 2, 4, 2, 4, 16


def _cfg(ffn=F, **over):
    moe = {"num_experts": E, "topk": 2, "ffn_hidden_size": ffn}
    return get_preset(
        "mixtral_tiny", num_layers=1, hidden_size=H, num_attention_heads=HEADS, num_kv_heads=GROUPS, vocab_size=V,
        moe=moe, **over,
    )  # fmt: skip


def _tensors():
    g = torch.Generator().manual_seed(0)
    shapes = {
        "embedding.word_embeddings.weight": (V, H),
        "output_layer.weight": (V, H),
        "decoder.final_layernorm.weight": (H,),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (1, H),
        "decoder.layers.self_attention.linear_qkv.weight": (1, GROUPS * 3 * D, H),
        "decoder.layers.self_attention.linear_proj.weight": (1, H, HEADS * D),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (1, H),
        "decoder.layers.mlp.router.weight": (1, E, H),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": (1, E, 2 * F, H),
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (1, E, H, F),
    }
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _store(path, tensors):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(tensors, checkpoint_id=str(path), no_dist=True)
    return str(path)


def test_names_and_fused_qkv_map_onto_the_engine(tmp_path):
    t = _tensors()
    src = _store(tmp_path / "iter_0000012", t)
    path = convert_megatron(src, str(tmp_path / "out"), _cfg())
    assert path.endswith("step_00000012")
    p = dict(load_model(str(tmp_path / "out")).named_parameters())
    qkv = t["decoder.layers.self_attention.linear_qkv.weight"][0]
    rows = {"q": [0, 1, 2, 3, 12, 13, 14, 15], "k": [4, 5, 6, 7, 16, 17, 18, 19], "v": [8, 9, 10, 11, 20, 21, 22, 23]}
    for x, r in rows.items():
        assert torch.equal(p[f"layers.0.attention.{x}_proj.weight"], qkv[r])
    same = {
        "mlp.experts.fc1_weight": "mlp.experts.experts.linear_fc1.weight",
        "mlp.experts.fc2_weight": "mlp.experts.experts.linear_fc2.weight",
        "input_norm.weight": "self_attention.linear_qkv.layer_norm_weight",
        "post_attention_norm.weight": "mlp.linear_fc1.layer_norm_weight",
        "mlp.router.weight": "mlp.router.weight",
    }
    for ours, theirs in same.items():
        assert torch.equal(p[f"layers.0.{ours}"], t[f"decoder.layers.{theirs}"][0]), ours
    assert torch.equal(p["output_weight"], t["output_layer.weight"])
    # checkpoint.init_from_megatron fills a model with exactly these tensors
    model = MoETransformer(_cfg().for_inference(), initialize=False)
    load_megatron_weights([model], check_init_megatron(src, _cfg()))
    assert all(torch.equal(q, p[n]) for n, q in model.named_parameters())


@pytest.mark.parametrize(
    "key, why",
    [
        ("decoder.layers.self_attention.linear_kv_down_proj.weight", "multi-latent attention"),
        ("decoder.layers.mlp.experts.experts.linear_fc1.bias", "linear biases"),
        ("decoder.layers.mlp.gizmo.weight", "not a tensor of this model"),
    ],
)
def test_an_unknown_key_is_refused_by_name_before_anything_is_written(tmp_path, key, why):
    t = _tensors()
    t[key] = torch.zeros(1, 3)
    src = _store(tmp_path / "m", t)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=f"{key.replace('.', '[.]')}: {why}"):
        convert_megatron(src, str(out), _cfg())
    assert not out.exists() and os.listdir(tmp_path) == ["m"]
    with pytest.raises(ConfigError, match="checkpoint.init_from_megatron=.*" + key.replace(".", "[.]")):
        check_init_megatron(src, _cfg())


def test_another_model_or_a_missing_tensor_is_named(tmp_path):
    t = _tensors()
    del t["output_layer.weight"]
    src = _store(tmp_path / "m", t)
    with pytest.raises(CheckpointError, match="output_weight: the checkpoint has no output_layer.weight"):
        convert_megatron(src, str(tmp_path / "o"), _cfg())
    src = _store(tmp_path / "m2", _tensors())
    with pytest.raises(CheckpointError, match=r"mlp.experts.fc1_weight: the checkpoint gives shape \(2, 8, 8\)"):
        convert_megatron(src, str(tmp_path / "o"), _cfg(ffn=6))
    os.makedirs(tmp_path / "exists")
    with pytest.raises(CheckpointError, match="already exists"):
        convert_megatron(src, str(tmp_path / "exists"), _cfg())


def test_init_from_megatron_is_checked_before_any_process_group(tmp_path):
    from folding.job.validate import validate_job

    def job(**ck):
        return JobConfig(model=get_preset("mixtral_tiny"), checkpoint=CheckpointConfig(**ck))

    with pytest.raises(ConfigError, match="checkpoint.init_from_megatron=.*is not a directory"):
        validate_job(job(init_from_megatron=str(tmp_path / "nothing")), world_size=1)
    with pytest.raises(ConfigError, match="checkpoint.init_from_megatron=.*is not a Megatron-Core torch_dist"):
        validate_job(job(init_from_megatron=str(tmp_path)), world_size=1)
    src = _store(tmp_path / "m", _tensors())
    with pytest.raises(ConfigError, match="checkpoint.init_from_megatron=.*checkpoint.load=.*both choose"):
        validate_job(job(init_from_megatron=src, load=src), world_size=1)
    validate_job(job(init_from_megatron=src), world_size=1)
