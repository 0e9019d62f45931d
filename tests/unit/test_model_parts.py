"""Model parts at 1 rank: vocab-parallel cross-entropy, CP chunking, RoPE, layout-independent init, errors."""

import dataclasses
import math

import pytest
import torch

from folding.model.context_parallel import check_cp_seq_len, cp_positions, gathered_positions
from folding.model.hf.config import config_from_hf, config_to_hf
from folding.model.presets import get_preset
from folding.model.transformer import MoETransformer
from folding.moe.settings import LayerSettings
from folding.parallel.params import ParamSpec, local_value, param_seed, shard_index, take_slice
from tests.unit.test_model_reference_moe import reference_moe_factory


def test_cp_chunks_are_load_balanced():
    # S=8, CP=2 -> 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert cp_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert gathered_positions(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    # every rank has the same causal work: sum over its queries of (position + 1)
    work = [int((cp_positions(32, r, 4) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match=r"not divisible by 2\*parallel.cp = 4"):
        check_cp_seq_len(10, 2, 1)
    with pytest.raises(ValueError, match="parallel.tp=4"):
        check_cp_seq_len(20, 2, 4)


def test_init_slices_are_those_of_the_full_tensor():
    spec = ParamSpec(full_shape=(8, 2, 6, 4), shards=((0, 1, 4), (2, 2, 3)), std=0.5)
    full = local_value(ParamSpec(full_shape=(8, 2, 6, 4), std=0.5), 3, "x")
    part = local_value(spec, 3, "x")
    assert torch.equal(part, take_slice(full, spec.shards)) and tuple(part.shape) == (2, 2, 2, 4)
    assert torch.equal(full[shard_index(spec.full_shape, spec.shards)], part)
    # drawn one slice of dim 0 at a time (experts): a rank draws only its own, same numbers in every split
    chunked = dataclasses.replace(spec, chunk_dim=0)
    whole = local_value(ParamSpec(full_shape=(8, 2, 6, 4), std=0.5, chunk_dim=0), 3, "x")
    assert torch.equal(local_value(chunked, 3, "x"), take_slice(whole, spec.shards))
    assert not torch.equal(whole, full)  # another drawing order, so other numbers
    assert param_seed(3, "x") != param_seed(3, "y") and param_seed(3, "x") != param_seed(4, "x")
    assert tuple(shard_index(spec.full_shape, spec.shards)) == (slice(2, 4), slice(0, 2), slice(4, 6), slice(0, 4))
    # same seed, same model; another seed, another model (the engine's MoE layer and the reference one)
    cfg = get_preset("mixtral_tiny", num_layers=1)
    for factory in (None, reference_moe_factory):
        a = MoETransformer(cfg, settings=LayerSettings(init_seed=1), moe_factory=factory)
        b = MoETransformer(cfg, settings=LayerSettings(init_seed=1), moe_factory=factory)
        c = MoETransformer(cfg, settings=LayerSettings(init_seed=2), moe_factory=factory)
        for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
            assert torch.equal(p, q), n
            if "norm" not in n:
                assert not torch.equal(p, r), n
        std = a.layers["0"].attention.q_proj.weight.std().item()
        assert abs(std - cfg.init_std) < 0.1 * cfg.init_std
        fc2 = a.layers["0"].mlp.experts.fc2_weight.std().item()
        assert abs(fc2 - cfg.output_init_std) < 0.1 * cfg.output_init_std  # residual-stream projection


def test_bad_inputs_fail_clearly():
    model = MoETransformer(get_preset("mixtral_tiny", num_layers=1), moe_factory=reference_moe_factory)
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, seq\]"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="labels must have the shape"):
        model(torch.zeros(2, 4, dtype=torch.long), labels=torch.zeros(2, 3, dtype=torch.long))


def test_moe_config_follows_the_hf_routers():
    mix = get_preset("mixtral_8x7b").moe
    assert (mix.num_experts, mix.topk, mix.ffn_hidden_size, mix.pre_softmax) == (8, 2, 14336, False)
    assert mix.capacity_factor is None and mix.input_jitter_eps is None and mix.aux_loss_type == "aux_loss"
    qw = get_preset("qwen2_57b_a14b").moe
    assert qw.pre_softmax and qw.shared_expert_ffn_hidden_size == 20480 and qw.shared_expert_gate
    # Qwen2-MoE's norm_topk_prob=true renormalizes the pre-softmax top-k, which is post-softmax
    hf = config_to_hf(get_preset("qwen2_moe_tiny"))
    assert hf["norm_topk_prob"] is False and config_from_hf(hf).moe.pre_softmax
    assert not config_from_hf(dict(hf, norm_topk_prob=True)).moe.pre_softmax


def test_every_parameter_has_one_record_and_save_refuses_one_without():
    from folding.parallel.params import _ATTR, param_spec, require_spec

    for factory in (None, reference_moe_factory):  # the engine's MoE layer and the reference one
        model = MoETransformer(get_preset("qwen2_moe_tiny", num_layers=2), moe_factory=factory)
        for name, p in model.named_parameters():
            spec = require_spec(p, name)  # full shape and slice recorded by the module that made it
            assert math.prod(spec.full_shape) == p.numel(), name  # 1 rank: the slice is all of it
            assert param_spec(p) is spec
            assert spec.expert == (".experts." in name), name
    p = next(model.parameters())
    delattr(p, _ATTR)
    with pytest.raises(ValueError, match="has no init/shard record"):
        require_spec(p, "embedding.weight")


def test_hf_aux_loss_coefficient_is_the_models_own_whatever_output_router_logits_says():
    from folding.model.hf.config import config_from_hf, config_to_hf

    base = dict(
        model_type="mixtral",
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        num_local_experts=4,
        intermediate_size=16,
        router_aux_loss_coef=0.02,
    )
    # the model's own coefficient whatever output_router_logits says (save_pretrained writes it false for
    # models trained with the loss); absent, no loss
    assert config_from_hf(base).moe.aux_loss_coeff == 0.02
    assert config_from_hf(dict(base, output_router_logits=False)).moe.aux_loss_coeff == 0.02
    assert config_from_hf({k: v for k, v in base.items() if k != "router_aux_loss_coef"}).moe.aux_loss_coeff == 0.0
    cfg = config_from_hf(dict(base, output_router_logits=True))
    assert cfg.moe.aux_loss_coeff == 0.02
    assert config_from_hf(config_to_hf(cfg)) == cfg.replace(name="hf_mixtral")


def test_one_rank_model_needs_no_process_group():
    # a fresh process: build, run forward and backward with either dispatcher, never touching torch.distributed
    import subprocess
    import sys

    code = """
import torch, torch.distributed as dist
from folding.model.presets import get_preset
from folding.model.transformer import MoETransformer
from folding.moe.settings import LayerSettings
cfg = get_preset("mixtral_tiny")
ids = torch.randint(0, cfg.vocab_size, (2, 16))
outs = []
for kind in ("alltoall", "allgather"):
    m = MoETransformer(cfg.replace(moe={"dispatcher": kind}), settings=LayerSettings(init_seed=3))
    y = m(ids)
    y.float().square().mean().backward()
    outs.append(y)
assert torch.equal(outs[0], outs[1])
print("initialized", dist.is_initialized(), "grads", all(p.grad is not None for p in m.parameters()))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "initialized False grads True", r.stdout
