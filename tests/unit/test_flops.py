"""FLOPs per token against values worked out by hand for the tiny presets."""

import pytest

from folding.model.presets import get_preset
from folding.planning.flops import flops_per_token, mfu


def test_mixtral_tiny_by_hand():
    # H=64, 8 heads of d=8, 4 KV heads, 8 experts of F=96, top-2, V=512, 4 layers (all MoE), s=16.
    f = flops_per_token(get_preset("mixtral_tiny"), seq_length=16)
    per_layer_linear = 2 * 64 * (8 + 2 * 4) * 8 + 2 * 8 * 8 * 64  # QKV 16384 + O 8192
    assert per_layer_linear == 24576
    assert f.attention_linear == 4 * 24576
    assert f.attention_core == 4 * (2 * 2 * 8 * 8 * 16 / 2)  # causal: keys average s/2 -> 2048
    assert f.router == 4 * 2 * 64 * 8
    assert f.routed_experts == 4 * 2 * 6 * 64 * 96  # top-2 SwiGLU experts
    assert f.shared_experts == 0 and f.dense_mlp == 0
    assert f.output_layer == 2 * 64 * 512
    assert f.forward == 4 * (24576 + 2048 + 1024 + 73728) + 65536 == 471040
    assert f.model_training == 3 * 471040
    assert f.recompute_extra("none") == 0
    assert f.recompute_extra("selective") == 4 * (24576 + 2048)  # the attention sublayer again
    assert f.recompute_extra("moe") == 4 * (1024 + 73728)  # router + experts again
    assert f.recompute_extra("full") == 471040 - 65536  # every layer again, not the output layer
    assert f.hardware_training("full") == 4 * 471040 - 65536


def test_qwen2_tiny_shared_expert_and_dense_layer():
    cfg = get_preset("qwen2_moe_tiny")
    f = flops_per_token(cfg, seq_length=16)
    # Experts F=32 top-2: 2*6*64*32 = 24576; shared F=64 plus its sigmoid gate: 6*64*64 + 2*64 = 24704.
    assert f.routed_experts == 4 * 24576
    assert f.shared_experts == 4 * 24704
    assert f.forward == 4 * (24576 + 2048 + 1024 + 24576 + 24704) + 65536 == 373248
    # Layer 0 dense (SwiGLU F=128: 6*64*128 = 49152) instead of router + experts + shared (50304).
    g = flops_per_token(cfg.replace(mlp_only_layers=(0,)), seq_length=16)
    assert g.dense_mlp == 49152
    assert g.forward == 373248 - 50304 + 49152


def test_attention_core_grows_with_sequence():
    cfg = get_preset("mixtral_tiny")
    assert flops_per_token(cfg, 32).attention_core == 2 * flops_per_token(cfg, 16).attention_core


def test_published_scale_mixtral_8x22b():
    # 2 * active params is the usual rough estimate; ours adds attention and discounts embeddings.
    cfg = get_preset("mixtral_8x22b")
    f = flops_per_token(cfg, seq_length=4096)
    total, active = cfg.num_parameters()
    approx = 2 * (active - cfg.vocab_size * cfg.hidden_size)  # embedding lookup is not a matmul
    assert f.forward == pytest.approx(approx + f.attention_core, rel=1e-3)


def test_mfu_definition():
    cfg = get_preset("mixtral_tiny")
    per_token = flops_per_token(cfg, 16).model_training
    assert mfu(
        cfg, seq_length=16, tokens_per_second=1000.0, num_gpus=2, peak_flops_per_gpu=per_token * 1000.0
    ) == pytest.approx(0.5)


def test_bad_input():
    cfg = get_preset("mixtral_tiny")
    with pytest.raises(ValueError, match="seq_length"):
        flops_per_token(cfg, 0)
    with pytest.raises(ValueError, match="recompute"):
        flops_per_token(cfg, 16).recompute_extra("some")


def test_deepseek_v3_tiny_mla_by_hand():
    # deepseek_v3_tiny: H=64, N=8 heads, Rq=32, Rkv=32, dn=16, dr=8, dv=16; per layer projections:
    # q_a 64*32, q_b 32*8*24, kv_a 64*(32+8), kv_b 32*8*(16+16), o 8*16*64 (x2 FLOPs each)
    cfg = get_preset("deepseek_v3_tiny")
    linear = 2 * (64 * 32 + 32 * 8 * 24 + 64 * 40 + 32 * 8 * 32 + 8 * 16 * 64)
    # core: Q.K^T over dn+dr=24 and P.V over dv=16 for N=8 heads, s_kv = s/2 = 8 at s=16
    core = 2 * 8 * (24 + 16) * 8
    f = flops_per_token(cfg, seq_length=16)
    assert f.attention_linear == 4 * linear and f.attention_core == 4 * core
    # the full model: 671B parameters, ~37.5B active -> about 6 x active plus attention per token
    big = flops_per_token(get_preset("deepseek_v3"), seq_length=4096)
    assert 6 * 37.0e9 < big.model_training < 6 * 37.6e9 + 3 * big.attention_core + 1e9
