"""Model presets: the published hyper-parameters of Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE, and tiny CPU twins.

``mixtral_8x7b``, ``mixtral_8x22b``, ``qwen2_57b_a14b``, ``qwen3_30b_a3b``, ``qwen3_235b_a22b`` and
``olmoe_1b_7b`` copy the values of the released ``config.json`` files (Qwen/Qwen3-30B-A3B,
Qwen/Qwen3-235B-A22B, allenai/OLMoE-1B-7B-0924 for the last three). ``mixtral_tiny``,
``qwen2_moe_tiny``, ``qwen3_moe_tiny`` and ``olmoe_tiny`` keep the architectures (8 routed experts,
GQA 8/4 heads, 4 layers, vocab a multiple of 128, sizes multiples of 8; Qwen3's per-head q/k norm
with a head_dim other than hidden/heads, OLMoE's q/k norm over the whole projection) at a size that
8 CPU ranks can run in every test layout.

Usage::

    cfg = get_preset("mixtral_tiny")
    cfg = get_preset("mixtral_tiny", hidden_size=128)     # overrides, validated
    list_presets()
"""

from __future__ import annotations

from typing import Dict, List

from ..moe.config import MoEConfig
from .config import ModelConfig
from .mla_config import MLAConfig
from .yarn_config import YarnConfig

_PRESETS: Dict[str, ModelConfig] = {}


def _register(cfg: ModelConfig) -> None:
    _PRESETS[cfg.name] = cfg


_register(
    ModelConfig(
        name="mixtral_8x7b",
        family="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        num_layers=32,
        num_attention_heads=32,
        num_kv_heads=8,
        moe=MoEConfig(num_experts=8, topk=2, ffn_hidden_size=14336, aux_loss_coeff=0.02),
        rope_theta=1e6,
        max_position_embeddings=32768,
        norm_eps=1e-5,
    )
)
_register(
    ModelConfig(
        name="mixtral_8x22b",
        family="mixtral",
        vocab_size=32768,
        hidden_size=6144,
        num_layers=56,
        num_attention_heads=48,
        num_kv_heads=8,
        moe=MoEConfig(num_experts=8, topk=2, ffn_hidden_size=16384, aux_loss_coeff=0.001),
        rope_theta=1e6,
        max_position_embeddings=65536,
        norm_eps=1e-5,
    )
)
_register(
    ModelConfig(
        name="qwen2_57b_a14b",
        family="qwen2_moe",
        vocab_size=151936,
        hidden_size=3584,
        num_layers=28,
        num_attention_heads=28,
        num_kv_heads=4,
        ffn_hidden_size=18944,
        moe=MoEConfig(
            num_experts=64,
            topk=8,
            ffn_hidden_size=2560,
            shared_expert_ffn_hidden_size=20480,
            shared_expert_gate=True,
            pre_softmax=True,
            aux_loss_coeff=0.001,
        ),
        qkv_bias=True,
        rope_theta=1e6,
        max_position_embeddings=32768,
        norm_eps=1e-6,
    )
)
# The default model of the README's main command. Its init std and aux-loss weight are the demo's
# (measured in docs/routing.md#a-collapsed-router): with the large models' 0.02 and 0.01 every layer's
# router sends nearly all tokens to one expert from step 3 on; with 0.1 and 0.3 (and optim.lr=1.5e-3
# in configs/config.yaml) every layer stays at or below 2x the mean load after step 10.
_register(
    ModelConfig(
        name="mixtral_tiny",
        family="mixtral",
        vocab_size=512,
        hidden_size=64,
        num_layers=4,
        num_attention_heads=8,
        num_kv_heads=4,
        moe=MoEConfig(num_experts=8, topk=2, ffn_hidden_size=96, aux_loss_coeff=0.3),
        init_std=0.1,
        rope_theta=1e6,
        max_position_embeddings=4096,
        norm_eps=1e-5,
    )
)
_register(
    ModelConfig(
        name="qwen2_moe_tiny",
        family="qwen2_moe",
        vocab_size=512,
        hidden_size=64,
        num_layers=4,
        num_attention_heads=8,
        num_kv_heads=4,
        ffn_hidden_size=128,
        moe=MoEConfig(
            num_experts=8,
            topk=2,
            ffn_hidden_size=32,
            shared_expert_ffn_hidden_size=64,
            shared_expert_gate=True,
            pre_softmax=True,
            aux_loss_coeff=0.01,
        ),
        qkv_bias=True,
        rope_theta=1e6,
        max_position_embeddings=4096,
        norm_eps=1e-6,
    )
)

# Qwen3-MoE: per-head q/k RMSNorm, head_dim 128 (not hidden/heads), no q/k/v bias, no shared expert,
# every layer MoE, softmax over all experts then top-8 renormalized (norm_topk_prob=true: pre_softmax=false).
_register(
    ModelConfig(
        name="qwen3_30b_a3b",
        family="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_attention_heads=32,
        num_kv_heads=4,
        head_dim=128,
        moe=MoEConfig(num_experts=128, topk=8, ffn_hidden_size=768, pre_softmax=False, aux_loss_coeff=0.001),
        qk_norm="head",
        rope_theta=1e6,
        max_position_embeddings=40960,
        norm_eps=1e-6,
    )
)
_register(
    ModelConfig(
        name="qwen3_235b_a22b",
        family="qwen3_moe",
        vocab_size=151936,
        hidden_size=4096,
        num_layers=94,
        num_attention_heads=64,
        num_kv_heads=4,
        head_dim=128,
        moe=MoEConfig(num_experts=128, topk=8, ffn_hidden_size=1536, pre_softmax=False, aux_loss_coeff=0.001),
        qk_norm="head",
        rope_theta=1e6,
        max_position_embeddings=40960,
        norm_eps=1e-6,
    )
)
# OLMoE: q/k RMSNorm over the whole projection outputs, 16 heads without GQA, 64 experts, top-8 without
# renormalization (norm_topk_prob=false: pre_softmax=true).
_register(
    ModelConfig(
        name="olmoe_1b_7b",
        family="olmoe",
        vocab_size=50304,
        hidden_size=2048,
        num_layers=16,
        num_attention_heads=16,
        num_kv_heads=16,
        moe=MoEConfig(num_experts=64, topk=8, ffn_hidden_size=1024, pre_softmax=True, aux_loss_coeff=0.01),
        qk_norm="full",
        rope_theta=10000.0,
        max_position_embeddings=4096,
        norm_eps=1e-5,
    )
)
_register(
    ModelConfig(
        name="qwen3_moe_tiny",
        family="qwen3_moe",
        vocab_size=512,
        hidden_size=64,
        num_layers=4,
        num_attention_heads=8,
        num_kv_heads=4,
        head_dim=16,
        moe=MoEConfig(num_experts=8, topk=2, ffn_hidden_size=32, pre_softmax=False, aux_loss_coeff=0.01),
        qk_norm="head",
        rope_theta=1e6,
        max_position_embeddings=4096,
        norm_eps=1e-6,
    )
)
_register(
    ModelConfig(
        name="olmoe_tiny",
        family="olmoe",
        vocab_size=512,
        hidden_size=64,
        num_layers=4,
        num_attention_heads=8,
        num_kv_heads=4,
        moe=MoEConfig(num_experts=8, topk=2, ffn_hidden_size=32, pre_softmax=True, aux_loss_coeff=0.01),
        qk_norm="full",
        rope_theta=10000.0,
        max_position_embeddings=4096,
        norm_eps=1e-5,
    )
)


def list_presets() -> List[str]:
    """Names of every preset."""
    return sorted(_PRESETS)


def get_preset(name: str, **overrides) -> ModelConfig:
    """The preset ``name``, with field ``overrides`` applied; unknown names list the choices."""
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(list_presets())}")
    cfg = _PRESETS[name]
    return cfg.replace(**overrides) if overrides else cfg


# Models of the MoE Parallel Folding paper's benchmarks (docs/planner.md, "Calibration and results") that
# have no released checkpoint.
# Mixtral-8x22B-G8T8: Mixtral-8x22B with every expert cut into 8 fine-grained experts (64 experts of
# F = 16384/8 = 2048) and top-8 routing: the same total expert parameters as 8x22B, half the active ones
# (8·2048 vs 2·16384 FFN width per token).
_register(
    ModelConfig(
        name="mixtral_8x22b_g8t8",
        family="mixtral",
        vocab_size=32768,
        hidden_size=6144,
        num_layers=56,
        num_attention_heads=48,
        num_kv_heads=8,
        moe=MoEConfig(num_experts=64, topk=8, ffn_hidden_size=2048, aux_loss_coeff=0.001),
        rope_theta=1e6,
        max_position_embeddings=65536,
        norm_eps=1e-5,
    )
)
# Llama3-8x70B: Llama-3-70B's attention and vocabulary with 8 experts, each one Llama-3-70B FFN, top-2.
_register(
    ModelConfig(
        name="llama3_8x70b",
        family="mixtral",
        vocab_size=128256,
        hidden_size=8192,
        num_layers=80,
        num_attention_heads=64,
        num_kv_heads=8,
        moe=MoEConfig(num_experts=8, topk=2, ffn_hidden_size=28672, aux_loss_coeff=0.001),
        rope_theta=500000.0,
        max_position_embeddings=8192,
        norm_eps=1e-5,
    )
)
# DeepSeek-V3 (the released config.json): multi-head latent attention, YaRN RoPE (factor 40 over 4096
# positions), 3 dense layers then 58 MoE layers of 256 sigmoid-routed experts (top-8 within the best
# 4 of 8 groups, routed scaling 2.5, aux-loss-free correction bias) plus one shared expert, and one
# multi-token-prediction module (num_nextn_predict_layers=1): 671.0e9 parameters without it, 682.6e9 with
# it, 685e9 counting the copies of the embedding and output layer the released checkpoint stores for it.
# Training adds the sequence-wise balance loss with alpha = 1e-4 and weighs the MTP loss 0.3 for the
# first 10T tokens, then 0.1 (DeepSeek-V3 technical report, sections 4.2 and 2.2); 0.1 here.
_register(
    ModelConfig(
        name="deepseek_v3",
        family="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        num_layers=61,
        num_attention_heads=128,
        num_kv_heads=128,
        ffn_hidden_size=18432,
        moe=MoEConfig(
            num_experts=256,
            topk=8,
            ffn_hidden_size=2048,
            score_function="sigmoid",
            expert_bias=True,
            num_groups=8,
            group_topk=4,
            group_score_topk=2,
            topk_scaling_factor=2.5,
            shared_expert_ffn_hidden_size=2048,
            aux_loss_type="seq_aux_loss",
            aux_loss_coeff=1e-4,
        ),
        mlp_only_layers=(0, 1, 2),
        rope_theta=10000.0,
        max_position_embeddings=163840,
        norm_eps=1e-6,
        mla=MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        yarn=YarnConfig(
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        mtp_num_layers=1,
    )
)
# Its CPU twin: the same architecture (q LoRA, YaRN with both mscales, 4 groups of 2 experts, top-2
# within 2 groups, ungated shared expert, first layer dense, one MTP module) at the tiny presets' size.
_register(
    ModelConfig(
        name="deepseek_v3_tiny",
        family="deepseek_v3",
        vocab_size=512,
        hidden_size=64,
        num_layers=4,
        num_attention_heads=8,
        num_kv_heads=8,
        ffn_hidden_size=128,
        moe=MoEConfig(
            num_experts=8,
            topk=2,
            ffn_hidden_size=32,
            score_function="sigmoid",
            expert_bias=True,
            num_groups=4,
            group_topk=2,
            group_score_topk=2,
            topk_scaling_factor=2.5,
            shared_expert_ffn_hidden_size=32,
            aux_loss_type="seq_aux_loss",
            aux_loss_coeff=0.01,
        ),
        mlp_only_layers=(0,),
        rope_theta=10000.0,
        max_position_embeddings=4096,
        norm_eps=1e-6,
        mla=MLAConfig(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        yarn=YarnConfig(
            factor=4.0,
            original_max_position_embeddings=1024,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=0.8,
        ),
        mtp_num_layers=1,
    )
)
