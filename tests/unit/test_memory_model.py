"""The analytic memory model: parameter counts of public models, hand-worked per-rank values, scaling."""
import pytest

from folding.parallel import ParallelLayout
from folding.model.presets import get_preset
from folding.planning.memory import ModelSizes, activation_bytes_per_layer, memory_per_rank, param_counts

KNOWN_SIZES = {k: ModelSizes.from_model_config(get_preset(k)) for k in ("mixtral_8x7b", "mixtral_8x22b",
                                                                        "qwen2_57b_a14b")}


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
    lay = ParallelLayout(world_size=8, tp=2, pp=2, ep=2, etp=1)       # DP2, EDP2
    first, last = param_counts(s, lay, stage=0), param_counts(s, lay, stage=1)
    # per layer: norms 2*4 + router 4*4 = 24 dense; experts 4/2 * 3*4*2 = 48; one layer per stage
    assert first.dense == 24 + 8 * 4 // 2 and first.expert == 48          # + embedding V*H/TP = 16
    assert last.dense == 24 + 4 + 16 and last.expert == 48               # + final norm + output layer
    e = memory_per_rank(s, lay, param_bytes=2, distributed=True, stage=1)
    assert (e.params_dense, e.grads_dense) == (44 * 2, 44 * 4)
    assert e.optimizer_dense == 12 * 44 // 2 and e.optimizer_expert == 12 * 48 // 2   # DP*CP = EDP = 2
    assert memory_per_rank(s, lay, param_bytes=4, stage=1).optimizer_dense == 8 * 44  # fp32: no master copy


def test_expert_scaling_at_fixed_world():
    s = KNOWN_SIZES["mixtral_8x7b"]
    by_ep = {ep: memory_per_rank(s, ParallelLayout(world_size=64, pp=4, ep=ep, etp=1), distributed=True)
             for ep in (1, 2, 4, 8)}
    for ep in (2, 4, 8):
        assert by_ep[ep].params_expert * ep == by_ep[1].params_expert
        assert by_ep[ep].grads_expert * ep == by_ep[1].grads_expert
        assert by_ep[ep].optimizer_expert == by_ep[1].optimizer_expert      # total/world under ZeRO-1


def test_activations_by_recompute_mode():
    s = KNOWN_SIZES["mixtral_8x7b"]
    lay = ParallelLayout(world_size=8, tp=2, ep=4, etp=1)
    acts = {m: activation_bytes_per_layer(s, lay, seq_length=4096, micro_batch_size=1, recompute=m)
            for m in ("none", "selective", "full")}
    assert acts["full"] == 2 * 2048 * 4096                                  # the layer input only
    assert acts["full"] < acts["selective"] < acts["none"]
    with pytest.raises(ValueError, match="recompute"):
        activation_bytes_per_layer(s, lay, seq_length=8, micro_batch_size=1, recompute="some")
    e = memory_per_rank(s, ParallelLayout(world_size=8, pp=2, ep=4, etp=1), seq_length=4096)
    assert e.stage == 0 and e.activations > 0                               # stage 0 holds PP micro-batches


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
