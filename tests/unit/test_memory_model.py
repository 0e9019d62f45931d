"""The analytic memory model: parameter counts of public models, hand-worked per-rank values, scaling."""

import pytest
import torch

from folding.model.config import ModelConfig
from folding.model.presets import get_preset
from folding.moe.config import MoEConfig
from folding.moe.settings import LayerSettings
from folding.parallel import ParallelLayout
from folding.planning.memory import (
    activation_bytes_per_layer,
    activation_terms,
    in_flight_chunks,
    layers_on_stage,
    logits_bytes,
    memory_per_rank,
    mtp_activation_bytes,
    param_counts,
    peak_candidate_stages,
    rope_bytes,
    stage_layers,
    transient_bytes,
)

KNOWN = {k: get_preset(k) for k in ("mixtral_8x7b", "mixtral_8x22b", "qwen2_57b_a14b")}


def hand_model(**changes) -> ModelConfig:
    """The model the hand-worked tests count: H=4, V=8, 2 layers (MoE), 2 query heads of d=2 and 1 KV head,
    E=4 experts of F=2, top-2, untied; ``changes`` as :meth:`ModelConfig.replace` takes them."""
    cfg = ModelConfig(
        name="hand",
        family="mixtral",
        vocab_size=8,
        hidden_size=4,
        num_layers=2,
        num_attention_heads=2,
        num_kv_heads=1,
        moe=MoEConfig(num_experts=4, topk=2, ffn_hidden_size=2),
    )
    return cfg.replace(**changes) if changes else cfg


def test_public_model_sizes():
    # published totals: Mixtral 8x7B 46.7B, 8x22B 141B, Qwen2-57B-A14B 57.4B
    one = ParallelLayout(world_size=1)
    totals = {k: (param_counts(s, one).dense + param_counts(s, one).expert) / 1e9 for k, s in KNOWN.items()}
    assert totals["mixtral_8x7b"] == pytest.approx(46.70, abs=0.01)
    assert totals["mixtral_8x22b"] == pytest.approx(140.6, abs=0.1)
    assert totals["qwen2_57b_a14b"] == pytest.approx(57.41, abs=0.01)


def test_hand_worked_small_model():
    # hand_model: H=4, V=8, 2 layers, 2 query heads of d=2 and 1 KV head, E=4 experts of F=2, untied
    s = hand_model()
    lay = ParallelLayout(world_size=8, tp=2, pp=2, ep=2, etp=1)  # DP2, EDP2
    first, last = param_counts(s, lay, stage=0), param_counts(s, lay, stage=1)
    # per layer: norms 2*4 + attention (q, k, v: 4*(2+2*1)*2 = 32, o: 2*2*4 = 16) over TP2 24 + router 4*4 = 48
    # dense; experts 4/2 * 3*4*2 = 48; one layer per stage
    assert first.dense == 48 + 8 * 4 // 2 and first.expert == 48  # + embedding V*H/TP = 16
    assert last.dense == 48 + 4 + 16 == 68 and last.expert == 48  # + final norm + output layer
    assert first.fp32 == last.fp32 == 16  # the router stays fp32 under bf16 parameters
    e = memory_per_rank(s, lay, param_bytes=2, distributed=True, stage=1)
    assert (e.params_dense, e.grads_dense) == (52 * 2 + 16 * 4, 68 * 4)
    # DP*CP = EDP = 2; moments for all, fp32 master copies for all but the router
    assert e.optimizer_dense == (8 * 68 + 4 * 52) // 2 and e.optimizer_expert == 12 * 48 // 2
    assert memory_per_rank(s, lay, param_bytes=4, stage=1).optimizer_dense == 8 * 68  # fp32: no master copy


def test_mtp_hand_worked_small_model():
    # the model above plus one multi-token-prediction module (its layer is number 2, MoE), TP2 PP2 EP2
    s = hand_model(mtp_num_layers=1)
    lay = ParallelLayout(world_size=8, tp=2, pp=2, ep=2, etp=1)
    first, last = param_counts(s, lay, stage=0), param_counts(s, lay, stage=1)
    assert (first.dense, first.expert) == (48 + 16, 48)  # unchanged: the module sits on the last stage
    # last: layer 1 (48) + final norm (4) + output layer (16) + the MTP layer (48) + its enorm, hnorm and output
    # norm 3*4 and eh_proj [4, 8] = 32, replicated over TP (44) + the last stage's own embedding copy (8*4/2)
    assert (last.dense, last.expert) == (48 + 4 + 16 + 48 + 44 + 16, 48 + 48) == (176, 96)
    # tied: the last stage's copy of the table is the output layer already
    tied = s.replace(tie_embeddings=True)
    assert param_counts(tied, lay, stage=1).dense == 176 - 16
    # one stage holds the single table: no copy
    one = ParallelLayout(world_size=4, tp=2, ep=2, etp=1)
    # adamw (what AdamW keeps under optim.name=muon): 2 norms of H=4 in each of 3 layers, 3 routers [4, 4],
    # the embedding and output shards (16 each), the final norm and MTP's 3 norms
    assert vars(param_counts(s, one)) == {
        "dense": 2 * 48 + 16 + 4 + 16 + 48 + 44,
        "expert": 3 * 48,
        "fp32": 3 * 16,
        "adamw": 3 * 2 * 4 + 3 * 16 + 16 + 16 + 4 + 3 * 4,
    }
    # a dense MTP layer (number 2 in mlp_only_layers): norms 8 + attention 24 + a SwiGLU of F=6 over TP2
    # (3*4*6/2 = 36), no experts
    dense = s.replace(mlp_only_layers=(2,), ffn_hidden_size=6)
    assert vars(param_counts(dense, lay, stage=1)) == {
        "dense": 48 + 4 + 16 + 8 + 24 + 36 + 44 + 16,
        "expert": 48,
        "fp32": 16,  # one router: layer 1's
        # layers 1 and 2's norms, one router, final norm, output layer, MTP's norms, the embedding copy
        "adamw": 2 * 2 * 4 + 16 + 4 + 16 + 3 * 4 + 16,
    }


def test_mtp_activations_by_hand():
    # H=4, 2 heads of d=2 (1 KV head), E=4 experts of F=2, top-2, one MTP module; TP2: T = 8/2 = 4 tokens per rank
    s = hand_model(mtp_num_layers=1)
    lay = ParallelLayout(world_size=8, tp=2, pp=2, ep=2, etp=1)
    kw = dict(seq_length=8, micro_batch_size=1)
    # its layer as any layer (768 bytes, test_activations_by_hand_small_model) plus, never recomputed: the inputs
    # of enorm and hnorm, of eh_proj [T, 2H] and of the output norm, a*T*5H = 160, and the three norms' rstd 12*T
    # = 48; its fused loss's input over the TP-gathered 8 tokens a*8*H = 64, their fp32 log-sum-exp 4*8 = 32,
    # the int64 ids and labels of its shifted tokens 16*8 = 128, and (all 8 tokens in one chunk) the softmax it
    # keeps [8, V/TP] fp32 = 128
    extra = 160 + 48 + 64 + 32 + 128 + 128
    assert mtp_activation_bytes(s, lay, **kw) == 768 + extra
    assert mtp_activation_bytes(s, lay, recompute="full", **kw) == 2 * 4 * 4 + extra
    assert mtp_activation_bytes(s.replace(mtp_num_layers=0), lay, **kw) == 0
    # on the last stage, once (one micro-batch of the last virtual stage is alive at the peak); stage 0 unchanged
    base = s.replace(mtp_num_layers=0)
    for rc in ("none", "full"):
        e = {k: memory_per_rank(k, lay, stage=1, recompute=rc, num_microbatches=4, **kw) for k in (s, base)}
        assert e[s].activations - e[base].activations == mtp_activation_bytes(s, lay, recompute=rc, **kw)
        assert memory_per_rank(s, lay, stage=0, recompute=rc, **kw) == memory_per_rank(
            base, lay, stage=0, recompute=rc, **kw
        )


def test_pipeline_stage_counts_match_the_model_with_mtp():
    """Per-stage counts at PP2 against the built stages (meta device) of deepseek_v3_tiny: 4 layers (layer 0
    dense) and one MTP module whose layer (number 4) is MoE, untied embedding."""
    from folding.model.transformer import MoETransformer
    from folding.optim.param_groups import uses_muon
    from folding.parallel.params import param_spec

    cfg = get_preset("deepseek_v3_tiny")
    base = cfg.replace(mtp_num_layers=0)
    lay = ParallelLayout(world_size=2, pp=2)

    def built(c, layer_range):  # bf16 parameters: what stays fp32 is counted apart too
        counts = {"dense": 0, "expert": 0, "fp32": 0, "adamw": 0}
        model = MoETransformer(
            c, settings=LayerSettings(device="meta", params_dtype=torch.bfloat16), layer_range=layer_range
        )
        for name, p in model.named_parameters():
            counts["expert" if param_spec(p).expert else "dense"] += p.numel()
            counts["fp32"] += p.numel() if p.dtype == torch.float32 else 0
            counts["adamw"] += 0 if uses_muon(name, p) else p.numel()
        return counts

    def same(model_counts, real):
        """Exact but for ``adamw``: the model leaves MLA's latent norms and biases with Muon's share
        (documented: under 0.01% of a layer), so it may undercount AdamW's elements by exactly those."""
        gap = real.pop("adamw") - model_counts.pop("adamw")
        assert 0 <= gap <= 1e-3 * (real["dense"] + real["expert"]), gap
        return model_counts == real

    plain = [vars(param_counts(base, lay, stage=k)) for k in range(2)]
    assert all(same(dict(m), b) for m, b in zip(plain, [built(base, (0, 2)), built(base, (2, 4))]))
    mtp = [vars(param_counts(cfg, lay, stage=k)) for k in range(2)]
    assert all(same(dict(m), b) for m, b in zip(mtp, [built(cfg, (0, 2)), built(cfg, (2, 4))])) and mtp[0] == plain[0]
    # the last stage adds what ModelConfig.num_parameters counts for the module (its MoE layer, norms and
    # eh_proj), its experts 8 * 3*64*32 among it, and its own copy of the untied embedding (512 x 64)
    added = cfg.num_parameters()[0] - base.num_parameters()[0]
    assert mtp[1]["expert"] - plain[1]["expert"] == 8 * 3 * 64 * 32
    assert mtp[1]["dense"] - plain[1]["dense"] == added - 8 * 3 * 64 * 32 + 512 * 64
    # one stage: the model's total (test_counts_match_model_config_presets), no second table
    whole = param_counts(cfg, ParallelLayout(world_size=1))
    rest = built(base, (0, 4))
    assert whole.dense + whole.expert == cfg.num_parameters()[0] == rest["dense"] + rest["expert"] + added
    assert same(dict(vars(whole)), built(cfg, (0, 4)))


def test_peak_candidate_stages():
    # DeepSeek-V3 on PP16 with a 1-layer last stage: stage 0 holds 3 dense layers and 1 MoE layer, stages 1-14
    # 4 MoE layers each (more experts than stage 0: stage 1 is a candidate, 2-14 hold less than it), stage 15
    big = get_preset("deepseek_v3")
    lay = ParallelLayout(world_size=1024, tp=2, pp=16, ep=8, etp=1, last_stage_layers=1)
    assert peak_candidate_stages(big, lay) == [0, 1, 15]
    kw = dict(distributed=True, recompute="selective", seq_length=4096, num_microbatches=128)
    worst = memory_per_rank(big, lay, **kw)  # every stage
    assert worst == max((memory_per_rank(big, lay, stage=k, **kw) for k in (0, 1, 15)), key=lambda e: e.total)
    assert worst.stage == 1
    # Mixtral (all MoE, even split): the first and the last only
    assert peak_candidate_stages(KNOWN["mixtral_8x7b"], ParallelLayout(world_size=64, pp=8, ep=8, etp=1)) == [
        0,
        7,
    ]


def test_expert_scaling_at_fixed_world():
    s = KNOWN["mixtral_8x7b"]
    by_ep = {
        ep: memory_per_rank(s, ParallelLayout(world_size=64, pp=4, ep=ep, etp=1), distributed=True)
        for ep in (1, 2, 4, 8)
    }
    for ep in (2, 4, 8):
        assert by_ep[ep].params_expert * ep == by_ep[1].params_expert
        assert by_ep[ep].grads_expert * ep == by_ep[1].grads_expert
        assert by_ep[ep].optimizer_expert == by_ep[1].optimizer_expert  # total/world under ZeRO-1


def test_activations_by_recompute_mode():
    s = KNOWN["mixtral_8x7b"]
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
    s = hand_model(vocab_size=9, num_layers=1)
    with pytest.raises(ValueError, match="vocab_size"):
        param_counts(s, ParallelLayout(world_size=2, tp=2, etp=1))


def test_counts_match_model_config_presets():
    """One rank's parts (the stages' layers, embedding, output layer, MTP modules) add up to the model's total."""
    from folding.model.presets import list_presets

    one = ParallelLayout(world_size=1)
    for name in list_presets():
        cfg = get_preset(name)
        c = param_counts(cfg, one)
        assert c.dense + c.expert == cfg.num_parameters()[0], name


def test_pipeline_stages_follow_the_partition():
    s = get_preset("qwen2_moe_tiny")
    lay = ParallelLayout(world_size=4, pp=2, vpp=2, ep=2, etp=1)
    per_stage = [param_counts(s, lay, stage=k) for k in range(2)]
    whole = param_counts(s, ParallelLayout(world_size=1))
    # every layer's experts live on exactly one stage (EP=2 halves them); the embedding is on stage 0
    assert sum(c.expert for c in per_stage) * 2 == whole.expert
    assert per_stage[0].dense != per_stage[1].dense


def test_activations_by_hand_small_model():
    # H=4, 2 heads of d=2 (1 KV head), E=4 experts of F=2, top-2, no aux loss; TP2 CP1 ETP1; s=8, mbs=1 -> T=4
    # tokens, R = T*k = 8 expert rows; bf16 (a=2). Each term is what the part that makes a tensor keeps.
    s = hand_model()
    lay = ParallelLayout(world_size=4, tp=2, ep=2, etp=1)
    kw = dict(seq_length=8, micro_batch_size=1)
    want = {
        "input": 2 * 4 * 4,  # a*T*H, kept by the input norm
        "residual": 2 * 4 * 4,  # x + attention, kept by the post-attention norm
        "norms": 2 * 2 * 4 * 4 + 2 * 4 * 4,  # both outputs 2*a*T*H, one fp32 rstd per token each: 64 + 32
        "attention": 2 * 4 * (4 + 2 * 2 + 4) + 4 * 4 * 2,  # a*T*(q nq*d + k,v 2*nkv*d + out nq*d) + lse 4*T*nq
        "router": 4 * (4 * 4 + 8 * 2 + 4 * 2),  # per token: fp32 logits 4E, top-k ids 8k, their softmax 4k
        "dispatch": 2 * 8 * 4 + 4 * 8 + 16 * 4 * 2,  # rows a*R*H, fp32 probs 4R, int64 token+expert ids 16*T*k
        "experts": 3 * 2 * 8 * 2,  # fc1's [R, 2F] output and fc2's [R, F] input: 3*a*R*F
        "shared_expert": 0,
        "mlp": 0,
    }
    assert activation_terms(s, lay, **kw) == want
    total = sum(want.values())
    assert activation_bytes_per_layer(s, lay, **kw) == total == 32 + 32 + 96 + 128 + 160 + 224 + 96 == 768
    # selective = core_attn: the kernel's log-sum-exp goes (its inputs and output are kept anyway)
    assert activation_bytes_per_layer(s, lay, recompute="selective", **kw) == total - 4 * 4 * 2
    moe_block = want["router"] + want["dispatch"] + want["experts"]
    assert activation_bytes_per_layer(s, lay, recompute="moe", **kw) == total - moe_block == 288
    assert activation_bytes_per_layer(s, lay, recompute="layernorm", **kw) == total - 2 * 2 * 4 * 4
    assert activation_bytes_per_layer(s, lay, recompute="moe_act", **kw) == total - 2 * 8 * 2
    assert activation_bytes_per_layer(s, lay, recompute="layernorm,moe_act", **kw) == total - 64 - 32
    # CP2 (TP2): T = 8/(2*2) = 2 tokens; K/V kept all-gathered over CP (2x the rank's tokens) and the chunked
    # kernel's chunk outputs beside their concatenation: a*T*(nq*d + 2*nkv*d*CP + 2*nq*d) + 4*T*nq = 96
    cp = ParallelLayout(world_size=4, tp=2, cp=2, ep=2, etp=1)
    assert activation_bytes_per_layer(s, cp, recompute="moe", **kw) == 16 + 16 + (32 + 16) + 96
    assert activation_bytes_per_layer(s, lay, recompute="full", **kw) == 2 * 4 * 4
    # a plain-autograd activation also keeps silu(gate) and silu(gate)*up: 2 more a*R*F = 64 bytes
    assert activation_bytes_per_layer(s, lay, fused_swiglu=False, **kw) == 768 + 2 * 2 * 8 * 2 == 832
    # dispatch buffers: permuted copies a*T*k*H, receive + sorted copies 2*a*R*H = 192, larger than the experts'
    # backward working set 5*a*R*F = 5*2*8*2 = 160; plus the recomputed region
    assert transient_bytes(s, lay, **kw) == 2 * 4 * 2 * 4 * 3
    assert transient_bytes(s, lay, recompute="moe", **kw) == 2 * 4 * 2 * 4 * 3 + moe_block
    # with experts four times as wide (F=8) the backward working set wins: 5*a*R*F = 5*2*8*8 = 640 > 192
    wide = hand_model(moe={"ffn_hidden_size": 8})
    assert transient_bytes(wide, lay, **kw) == 640
    # the last stage: the final norm's input a*T*H and rstd (48); the fused loss's input over s/CP = 8 tokens
    # a*8*H, one fp32 log-sum-exp and one int64 label per token (64 + 32 + 64); one chunk (all 8 tokens fit in
    # 2048) of fp32 logits + softmax [8, V/TP] = 256
    assert logits_bytes(s, lay, **kw) == 48 + 64 + 32 + 64 + 2 * 4 * 8 * (8 // 2) == 464
    # at 4096 tokens only one chunk of chunk_tokens rows of logits exists
    norm_4096 = 2 * 2048 * 4 + 4 * 2048
    loss_4096 = 2 * 4096 * 4 + 4 * 4096 + 8 * 4096
    assert logits_bytes(s, lay, seq_length=4096, micro_batch_size=1, chunk_tokens=1024) == (
        norm_4096 + loss_4096 + 2 * 4 * 1024 * 4
    )
    # a dense layer: a SwiGLU MLP of ffn_hidden_size keeps gate, up and the activation, 3F per token, instead
    # of the MoE terms
    d = hand_model(ffn_hidden_size=6)
    assert activation_bytes_per_layer(d, lay, moe_layer=False, **kw) == 32 + 32 + 96 + 128 + 3 * 2 * 4 * 6


def test_in_flight_chunks_follow_the_schedule():
    assert [in_flight_chunks(pp=4, vpp=1, stage=k) for k in range(4)] == [4, 3, 2, 1]  # 1F1B
    # interleaved: 2*(pp-stage-1) + (vpp-1)*pp + 1 chunk forwards (Megatron-Core's warm-up + 1)
    assert [in_flight_chunks(pp=4, vpp=2, stage=k) for k in range(4)] == [11, 9, 7, 5]
    assert in_flight_chunks(pp=4, vpp=2, stage=0, num_microbatches=2) == 4  # only 2*vpp forwards
    assert in_flight_chunks(pp=8, vpp=1, stage=0, num_microbatches=3) == 3
    with pytest.raises(ValueError, match="stage"):
        in_flight_chunks(pp=2, vpp=1, stage=2)


def test_memory_per_rank_pipeline_peak():
    s = KNOWN["mixtral_8x7b"]
    lay = ParallelLayout(world_size=64, pp=4, vpp=2, ep=8, etp=1)
    kw = dict(param_bytes=2, distributed=True, seq_length=4096, micro_batch_size=1)
    per = activation_bytes_per_layer(s, lay, seq_length=4096, micro_batch_size=1)
    rope = rope_bytes(s, lay, seq_length=4096)  # each chunk forward's cos/sin tables, 2*a*s*d
    assert rope == 2 * 2 * 4096 * 128
    e0 = memory_per_rank(s, lay, stage=0, **kw)
    assert e0.activations == per * 8 * 11 // 2 + 11 * rope  # 8 layers on the rank, 11 chunk forwards of 4 layers
    e3 = memory_per_rank(s, lay, stage=3, **kw)
    logits = logits_bytes(s, lay, seq_length=4096, micro_batch_size=1)
    assert e3.activations == per * 8 * 5 // 2 + 5 * rope + logits
    assert memory_per_rank(s, lay, stage=0, num_microbatches=1, **kw).activations == per * 8 * 2 // 2 + 2 * rope
    assert e0.total == sum(e0.by_part().values())
    with pytest.raises(ValueError, match="train.recompute"):
        memory_per_rank(s, lay, recompute="attention", **kw)


def test_dry_run_uses_the_same_model():
    import os

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from folding.job.config import job_config_from_dict
    from folding.job.schema import register_schema
    from folding.job.validate import validate_job
    from folding.launch.dry_run import dry_run_report, memory_estimate

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
        j.model,
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


def test_memory_tool_runs_on_a_preset():
    import subprocess
    import sys

    args = ["--model", "deepseek_v3_tiny", "--world", "4", "--tp", "2", "--pp", "2", "--ep", "2", "--etp", "1"]
    out = subprocess.run([sys.executable, "-m", "tools.memory", *args], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lay = ParallelLayout(world_size=4, tp=2, pp=2, ep=2, etp=1)
    c = param_counts(get_preset("deepseek_v3_tiny"), lay, stage=1)
    # bf16 parameters of the last stage: layers 2 and 3 and the MTP module's layer 4 (3 MoE layers of 4 local
    # experts of 3*64*32)
    assert c.expert == 3 * 4 * 3 * 64 * 32
    want = 2 * (c.dense - c.fp32) + 4 * c.fp32  # bf16, but the routers fp32
    assert f"stage 1: params_dense={want} B  params_expert={2 * c.expert} B" in out.stdout


def test_first_and_last_stage_layers_place_the_layers():
    """Qwen3-235B-A22B's published PP16 split (5, 14 x 6, 5): the memory model's stages hold those
    layers, and their expert parameters scale with them."""
    cfg = get_preset("qwen3_235b_a22b")
    lay = ParallelLayout(world_size=256, tp=4, cp=2, pp=16, first_stage_layers=5, last_stage_layers=5, ep=8, etp=1)
    assert [layers_on_stage(cfg, lay, k) for k in range(16)] == [5] + [6] * 14 + [5]
    assert stage_layers(cfg, lay, 15) == list(range(89, 94))
    first, middle = param_counts(cfg, lay, stage=0), param_counts(cfg, lay, stage=1)
    assert first.expert * 6 == middle.expert * 5
