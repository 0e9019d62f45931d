"""The analytic memory model: parameter counts of public models, hand-worked per-rank values, scaling."""

import pytest

from folding.model.presets import get_preset
from folding.parallel import ParallelLayout
from folding.planning.memory import (
    ModelSizes,
    activation_bytes_per_layer,
    in_flight_chunks,
    logits_bytes,
    memory_per_rank,
    param_counts,
    transient_bytes,
)

KNOWN_SIZES = {
    k: ModelSizes.from_model_config(get_preset(k)) for k in ("mixtral_8x7b", "mixtral_8x22b", "qwen2_57b_a14b")
}


def test_public_model_sizes():
    # published totals: Mixtral 8x7B 46.7B, 8x22B 141B, Qwen2-57B-A14B 57.4B
    one = ParallelLayout(world_size=1)
    totals = {k: sum(vars(param_counts(s, one)).values()) / 1e9 for k, s in KNOWN_SIZES.items()}
    assert totals["mixtral_8x7b"] == pytest.approx(46.70, abs=0.01)
    assert totals["mixtral_8x22b"] == pytest.approx(140.6, abs=0.1)
    assert totals["qwen2_57b_a14b"] == pytest.approx(57.41, abs=0.01)


def test_hand_worked_small_model():
    # H=4, V=8, 2 layers, E=4 experts of F=2, no attention, untied, 2 norms per layer
    s = ModelSizes(vocab_size=8, hidden_size=4, num_layers=2, num_experts=4, moe_ffn_hidden_size=2)
    lay = ParallelLayout(world_size=8, tp=2, pp=2, ep=2, etp=1)  # DP2, EDP2
    first, last = param_counts(s, lay, stage=0), param_counts(s, lay, stage=1)
    # per layer: norms 2*4 + router 4*4 = 24 dense; experts 4/2 * 3*4*2 = 48; one layer per stage
    assert first.dense == 24 + 8 * 4 // 2 and first.expert == 48  # + embedding V*H/TP = 16
    assert last.dense == 24 + 4 + 16 and last.expert == 48  # + final norm + output layer
    e = memory_per_rank(s, lay, param_bytes=2, distributed=True, stage=1)
    assert (e.params_dense, e.grads_dense) == (44 * 2, 44 * 4)
    assert e.optimizer_dense == 12 * 44 // 2 and e.optimizer_expert == 12 * 48 // 2  # DP*CP = EDP = 2
    assert memory_per_rank(s, lay, param_bytes=4, stage=1).optimizer_dense == 8 * 44  # fp32: no master copy


def test_expert_scaling_at_fixed_world():
    s = KNOWN_SIZES["mixtral_8x7b"]
    by_ep = {
        ep: memory_per_rank(s, ParallelLayout(world_size=64, pp=4, ep=ep, etp=1), distributed=True)
        for ep in (1, 2, 4, 8)
    }
    for ep in (2, 4, 8):
        assert by_ep[ep].params_expert * ep == by_ep[1].params_expert
        assert by_ep[ep].grads_expert * ep == by_ep[1].grads_expert
        assert by_ep[ep].optimizer_expert == by_ep[1].optimizer_expert  # total/world under ZeRO-1


def test_activations_by_recompute_mode():
    s = KNOWN_SIZES["mixtral_8x7b"]
    lay = ParallelLayout(world_size=8, tp=2, ep=4, etp=1)
    acts = {
        m: activation_bytes_per_layer(s, lay, seq_length=4096, micro_batch_size=1, recompute=m)
        for m in ("none", "selective", "moe", "full")
    }
    assert acts["full"] == 2 * 2048 * 4096  # the layer input only
    assert acts["full"] < acts["moe"] < acts["selective"] < acts["none"]
    with pytest.raises(ValueError, match="recompute"):
        activation_bytes_per_layer(s, lay, seq_length=8, micro_batch_size=1, recompute="some")
    e = memory_per_rank(s, ParallelLayout(world_size=8, pp=2, ep=4, etp=1), seq_length=4096)
    assert e.stage == 0 and e.activations > 0  # stage 0 holds PP micro-batches


def test_indivisible_sizes_are_named():
    s = ModelSizes(vocab_size=9, hidden_size=4, num_layers=1, num_experts=4, moe_ffn_hidden_size=2)
    with pytest.raises(ValueError, match="vocab_size"):
        param_counts(s, ParallelLayout(world_size=2, tp=2, etp=1))


def test_counts_match_model_config_presets():
    from folding.model.presets import get_preset, list_presets

    one = ParallelLayout(world_size=1)
    for name in list_presets():
        cfg = get_preset(name)
        c = param_counts(ModelSizes.from_model_config(cfg), one)
        assert c.dense + c.expert == cfg.num_parameters()[0], name


def test_pipeline_stages_follow_the_partition():
    s = ModelSizes.from_model_config(get_preset("qwen2_moe_tiny"))
    lay = ParallelLayout(world_size=4, pp=2, vpp=2, ep=2, etp=1)
    per_stage = [param_counts(s, lay, stage=k) for k in range(2)]
    whole = param_counts(s, ParallelLayout(world_size=1))
    # every layer's experts live on exactly one stage (EP=2 halves them); the embedding is on stage 0
    assert sum(c.expert for c in per_stage) * 2 == whole.expert
    assert per_stage[0].dense != per_stage[1].dense


def test_activations_by_hand_small_model():
    # H=4, 2 heads of d=2 (1 KV head), E=4 experts of F=2, top-2; TP2 CP1 ETP1; s=8, mbs=1 -> T=4 tokens,
    # R = T*k = 8 expert rows; bf16.
    s = ModelSizes(
        vocab_size=8,
        hidden_size=4,
        num_layers=2,
        num_experts=4,
        moe_ffn_hidden_size=2,
        num_attention_heads=2,
        num_query_groups=1,
    )
    lay = ParallelLayout(world_size=4, tp=2, ep=2, etp=1)
    norms = 2 * 2 * 4 * 4  # inputs of both norms: 2 * a*T*H
    attn = 2 * 4 * (4 + (2 + 2) * 2 + 2 * 2)  # a*T*(H + (nq+2nkv)d + nq*d)
    router = 2 * 4 * 4 + 8 * 4 * 4  # a*T*H + fp32 logits and probs 8*T*E
    # a*R*H (fc1's input) + 3*a*R*F (fc1's [R, 2F] output and fc2's [R, F] input, kept by the fused weighted
    # SwiGLU) + 4*R (fp32 probabilities, one per row) = 64 + 96 + 32 = 192
    experts = 2 * 8 * 4 + 3 * 2 * 8 * 2 + 4 * 8
    kw = dict(seq_length=8, micro_batch_size=1)
    # 64 + 128 + 160 + 192 = 544
    assert activation_bytes_per_layer(s, lay, **kw) == norms + attn + router + experts == 544
    assert activation_bytes_per_layer(s, lay, recompute="selective", **kw) == norms + router + experts
    assert activation_bytes_per_layer(s, lay, recompute="moe", **kw) == norms + attn
    # CP2 (TP2): T = 8/(2*2) = 2 tokens, R = 4; K/V are kept all-gathered over CP, 2x the rank's tokens:
    # a*T*(H + nq*d + 2*nkv*d*CP + nq*d) = 2*2*(4 + 4 + 8 + 4) = 80
    cp = ParallelLayout(world_size=4, tp=2, cp=2, ep=2, etp=1)
    assert activation_bytes_per_layer(s, cp, recompute="moe", **kw) == 2 * 2 * 2 * 4 + 80
    assert activation_bytes_per_layer(s, lay, recompute="full", **kw) == 2 * 4 * 4
    # a plain-autograd activation also keeps silu(gate) and silu(gate)*up: 2 more a*R*F = 64 bytes
    assert activation_bytes_per_layer(s, lay, fused_swiglu=False, **kw) == 544 + 2 * 2 * 8 * 2 == 608
    # dispatch buffers: permuted copies a*T*k*H, receive + sorted copies 2*a*R*H = 192, larger than the experts'
    # backward working set 5*a*R*F = 5*2*8*2 = 160; plus the recomputed region
    assert transient_bytes(s, lay, **kw) == 2 * 4 * 2 * 4 * 3
    assert transient_bytes(s, lay, recompute="moe", **kw) == 2 * 4 * 2 * 4 * 3 + router + experts
    # with experts four times as wide (F=8) the backward working set wins: 5*a*R*F = 5*2*8*8 = 640 > 192
    wide = ModelSizes(
        vocab_size=8,
        hidden_size=4,
        num_layers=2,
        num_experts=4,
        moe_ffn_hidden_size=8,
        num_attention_heads=2,
        num_query_groups=1,
    )
    assert transient_bytes(wide, lay, **kw) == 640
    # fused output layer + loss on the last stage, s/CP = 8 tokens: its bf16 input a*8*H, one fp32 log-sum-exp
    # per token, and one chunk (all 8 tokens fit in 2048) of fp32 logits + softmax [8, V/TP] = 64 + 32 + 256
    assert logits_bytes(s, lay, **kw) == 2 * 8 * 4 + 4 * 8 + 2 * 4 * 8 * (8 // 2) == 352
    # at 4096 tokens only one chunk of chunk_tokens rows of logits exists: 32768 + 16384 + 2*4*1024*4
    assert logits_bytes(s, lay, seq_length=4096, micro_batch_size=1, chunk_tokens=1024) == 32768 + 16384 + 32768
    # a dense layer: a SwiGLU MLP of ffn_hidden_size keeps its input and 4F per token instead of the MoE terms
    d = ModelSizes(
        vocab_size=8,
        hidden_size=4,
        num_layers=1,
        num_experts=4,
        moe_ffn_hidden_size=2,
        dense_layers=(0,),
        ffn_hidden_size=6,
    )
    assert activation_bytes_per_layer(d, lay, moe_layer=False, **kw) == 2 * 2 * 4 * 4 + 2 * 4 * 4 + 2 * 4 * 4 * 6


def test_in_flight_chunks_follow_the_schedule():
    assert [in_flight_chunks(pp=4, vpp=1, stage=k) for k in range(4)] == [4, 3, 2, 1]  # 1F1B
    # interleaved: 2*(pp-stage-1) + (vpp-1)*pp + 1 chunk forwards (Megatron-Core's warm-up + 1)
    assert [in_flight_chunks(pp=4, vpp=2, stage=k) for k in range(4)] == [11, 9, 7, 5]
    assert in_flight_chunks(pp=4, vpp=2, stage=0, num_microbatches=2) == 4  # only 2*vpp forwards
    assert in_flight_chunks(pp=8, vpp=1, stage=0, num_microbatches=3) == 3
    with pytest.raises(ValueError, match="stage"):
        in_flight_chunks(pp=2, vpp=1, stage=2)


def test_memory_per_rank_pipeline_peak():
    s = KNOWN_SIZES["mixtral_8x7b"]
    lay = ParallelLayout(world_size=64, pp=4, vpp=2, ep=8, etp=1)
    kw = dict(param_bytes=2, distributed=True, seq_length=4096, micro_batch_size=1)
    per = activation_bytes_per_layer(s, lay, seq_length=4096, micro_batch_size=1)
    e0 = memory_per_rank(s, lay, stage=0, **kw)
    assert e0.activations == per * 8 * 11 // 2  # 8 layers on the rank, 11 chunk forwards of 4 layers
    e3 = memory_per_rank(s, lay, stage=3, **kw)
    assert e3.activations == per * 8 * 5 // 2 + logits_bytes(s, lay, seq_length=4096, micro_batch_size=1)
    assert memory_per_rank(s, lay, stage=0, num_microbatches=1, **kw).activations == per * 8 * 2 // 2
    assert e0.total == sum(e0.by_part().values())
    with pytest.raises(ValueError, match="train.recompute"):
        memory_per_rank(s, lay, recompute="attention", **kw)


def test_dry_run_uses_the_same_model():
    import os

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from folding.training.config import job_config_from_dict
    from folding.training.dry_run import dry_run_report, memory_estimate
    from folding.training.schema import register_schema
    from folding.training.validate import validate_job

    register_schema()
    configs = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "configs"))

    def job(*overrides):
        with initialize_config_dir(config_dir=configs, version_base="1.3"):
            return job_config_from_dict(
                OmegaConf.to_container(compose("config", overrides=list(overrides)), resolve=True)
            )

    j = job("recipes=mixtral_8x22b")
    layout = validate_job(j, world_size=128)
    want = memory_per_rank(
        ModelSizes.from_model_config(j.model),
        layout,
        param_bytes=2,
        distributed=True,
        recompute="none",
        seq_length=4096,
        micro_batch_size=1,
        act_bytes=2,
        num_microbatches=256 // layout.dp,
    )
    assert memory_estimate(j, layout) == want
    assert f"{want.total / 2**30:.1f} GiB per rank on stage {want.stage}" in dry_run_report(j, world_size=128)
    # train.recompute=moe is estimated as itself (not as selective): only attention activations stay.
    jm = job("recipes=mixtral_8x22b", "train.recompute=moe")
    moe, sel = (
        memory_estimate(jm, layout),
        memory_estimate(job("recipes=mixtral_8x22b", "train.recompute=selective"), layout),
    )
    assert moe.activations < sel.activations < want.activations
