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
    assert f.recompute_extra("selective") == 4 * 2048  # the attention core again (selective = core_attn)
    assert f.recompute_extra("core_attn,moe") == 4 * (2048 + 1024 + 73728)  # modules add up
    assert f.recompute_extra("layernorm,moe_act") == 0  # element-wise work only, no GEMM
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
    f = flops_per_token(cfg.replace(mtp_num_layers=0), seq_length=16)
    assert f.attention_linear == 4 * linear and f.attention_core == 4 * core
    # with its multi-token-prediction module: a fifth attention block
    g = flops_per_token(cfg, seq_length=16)
    assert g.attention_linear == 5 * linear and g.attention_core == 5 * core
    # the full model without MTP: 671.0B parameters, 37.55B active -> about 6 x active plus attention per token
    big = flops_per_token(get_preset("deepseek_v3").replace(mtp_num_layers=0), seq_length=4096)
    assert 6 * 37.0e9 < big.model_training < 6 * 37.6e9 + 3 * big.attention_core + 1e9
    # with it: 682.6B parameters, 38.24B active (its layer and projection; it shares embedding and output
    # layer, whose GEMM it runs once more)
    mtp = flops_per_token(get_preset("deepseek_v3"), seq_length=4096)
    assert 6 * 38.2e9 < mtp.model_training < 6 * 38.3e9 + 3 * mtp.attention_core + 1e9


def test_mtp_module_by_hand():
    # deepseek_v3_tiny's one MTP module at s=16 adds, per token: its layer (number 4: MoE) = MLA projections
    # 2*(64*32 + 32*8*24 + 64*40 + 32*8*32 + 8*16*64) = 54272, core 2*8*(24+16)*8 = 5120, router 2*64*8 = 1024,
    # top-2 routed experts 2*6*64*32 = 24576, ungated shared expert 6*64*32 = 12288; its projection
    # [2H -> H] 2*128*64 = 16384; one more output layer 2*64*512 = 65536.
    cfg = get_preset("deepseek_v3_tiny")
    with_mtp, without = flops_per_token(cfg, 16), flops_per_token(cfg.replace(mtp_num_layers=0), 16)
    layer = 54272 + 5120 + 1024 + 24576 + 12288
    assert with_mtp.forward - without.forward == layer + 16384 + 65536 == 179200
    assert (with_mtp.mtp_projection, with_mtp.mtp_output_layer) == (16384, 65536)
    assert with_mtp.model_training - without.model_training == 3 * 179200
    # full recompute re-runs the MTP layer's forward, not its projection nor its output layer
    assert with_mtp.recompute_extra("full") - without.recompute_extra("full") == layer
    assert with_mtp.recompute_extra("moe") - without.recompute_extra("moe") == 1024 + 24576 + 12288
    # two modules: twice the term (layer number 5 is MoE too)
    two = flops_per_token(cfg.replace(mtp_num_layers=2), 16)
    assert two.forward - without.forward == 2 * 179200


def test_published_scale_deepseek_v3_with_mtp():
    # 2 x active params per token, as for Mixtral, plus the attention core: without MTP the embedding lookup is
    # not a matmul (2*(active - V*H)); the MTP module looks the embedding up again (free) but runs the shared
    # output layer once more (2*V*H), so with it the forward is 2 x active + core.
    cfg = get_preset("deepseek_v3")
    vh = cfg.vocab_size * cfg.hidden_size
    for c, lookup in ((cfg.replace(mtp_num_layers=0), vh), (cfg, 0)):
        f = flops_per_token(c, seq_length=4096)
        assert f.forward == pytest.approx(2 * (c.num_parameters()[1] - lookup) + f.attention_core, rel=1e-3)
