"""The job configuration: Hydra composition on the typed schema, presets as Hydra options, recipes, and
bad configs that fail before any process group with the setting named."""

import os

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from folding.job.config import ConfigError, job_config_from_dict
from folding.job.schema import register_schema
from folding.job.validate import validate_job
from folding.launch.dry_run import dry_run_report
from folding.model.presets import get_preset, list_presets

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
register_schema()


def compose_tree(*overrides):
    with initialize_config_dir(config_dir=os.path.abspath(CONFIGS), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=list(overrides)), resolve=True)


def job(*overrides):
    return job_config_from_dict(compose_tree(*overrides))


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_is_a_model_option_and_round_trips(name):
    j = job(f"model={name}")
    assert j.model == get_preset(name)  # the Hydra option is the Python preset, MoE record included
    assert job_config_from_dict(j.to_dict()).model == j.model


def test_presets_have_no_yaml_copy():
    assert not os.path.exists(os.path.join(CONFIGS, "model"))


def test_defaults_and_overrides_reach_typed_config():
    j = job(
        "parallel.tp=2",
        "parallel.ep=4",
        "parallel.etp=1",
        "model.hidden_size=128",
        "moe.capacity_factor=1.5",
        "train.steps=7",
        "optim.lr=0.001",
        "logging.wandb.mode=disabled",
    )
    layout = validate_job(j, world_size=4)
    assert (layout.dp, layout.edp, layout.etp) == (2, 1, 1)
    assert j.model.hidden_size == 128 and j.model.name == "mixtral_tiny"
    assert j.moe.capacity_factor == 1.5 and j.moe.topk == 2 and j.moe is j.model.moe
    assert j.moe.aux_loss_coeff == get_preset("mixtral_tiny").moe.aux_loss_coeff  # unset: the preset's
    assert j.train.steps == 7 and j.optim.lr == 0.001 and j.logging.wandb.mode == "disabled"
    q = job("model=qwen2_moe_tiny")
    assert q.moe.pre_softmax is True and q.moe.shared_expert_ffn_hidden_size == 64
    assert job("moe.topk=1", "moe.pre_softmax=true").moe.topk == 1
    q3, ol = job("model=qwen3_moe_tiny"), job("model=olmoe_tiny")
    assert (q3.model.qk_norm, q3.model.head_dim, q3.moe.pre_softmax) == ("head", 16, False)
    assert (ol.model.qk_norm, ol.moe.pre_softmax) == ("full", True)


@pytest.mark.parametrize(
    "recipe,world,expect",
    [
        ("mixtral_8x7b", 64, "attention TP1 CP1 DP16 PP4 VPP8 | MoE ETP1 EP8 EDP2 PP4"),
        ("mixtral_8x22b", 128, "attention TP2 CP1 DP8 PP8 | MoE ETP1 EP8 EDP2 PP8"),
        ("qwen2_57b_a14b", 64, "attention TP2 CP1 DP8 PP4 | MoE ETP1 EP4 EDP4 PP4"),
        ("qwen3_30b_a3b", 8, "attention TP4 CP1 DP1 PP2 | MoE ETP1 EP4 EDP1 PP2"),
        (
            "qwen3_235b_a22b",
            256,
            "attention TP4 CP2 DP2 PP16 (first stage 5 layers, last stage 5 layers) | MoE ETP1 EP8 EDP2 PP16",
        ),
        ("deepseek_v3", 1024, "attention TP2 CP2 DP16 PP16 (last stage 1 layer) | MoE ETP1 EP16 EDP4 PP16"),
        (
            "deepseek_v3_pp8_vpp4",
            1024,
            "attention TP2 CP1 DP64 PP8 VPP4 (layout Et|(tt|)*30mL) | MoE ETP1 EP64 EDP2 PP8",
        ),
        (
            "qwen3_235b_a22b_pp8_vpp4",
            256,
            "attention TP2 CP1 DP16 PP8 VPP4 (layout Ett|(ttt|)*30ttL) | MoE ETP1 EP32 EDP1 PP8",
        ),
    ],
)
def test_recipes_dry_run(recipe, world, expect):
    j = job(f"recipes={recipe}")
    assert j.parallel.world_size == world and j.train.precision == "bf16"
    assert validate_job(j, world_size=world).describe() == expect
    report = dry_run_report(j, world_size=world)
    assert expect in report and "parameters" in report
    with pytest.raises(ConfigError, match="parallel.world_size"):
        validate_job(j, world_size=2 * world)


# Each case: overrides, the world size, and the setting the message must name.
BAD = [
    (["parallel.tp=3"], 4, "parallel.tp"),  # world not divisible
    (["parallel.tp=2", "parallel.ep=4"], 4, "parallel.etp"),  # etp follows tp: 2*4 > 4
    (["parallel.ep=3", "parallel.etp=1"], 3, "ep"),  # 8 experts not divisible by 3
    (["parallel.tp=0"], 4, "parallel.tp"),
    (["parallel.vpp=2"], 4, "parallel.vpp"),  # vpp without pp
    (["parallel.order=tp-xx-ep-dp-pp"], 4, "order"),
    (["parallel.world_size=8"], 4, "parallel.world_size"),
    (["train.steps=0"], 1, "train.steps"),
    (["train.global_batch_size=10"], 4, "train.global_batch_size"),  # 10 % (2*4)
    (["train.micro_batch_size=0"], 1, "train.micro_batch_size"),
    (["train.seq_length=-4"], 1, "train.seq_length"),
    (["train.seq_length=8192"], 1, "train.seq_length"),  # > max_position_embeddings
    (["parallel.tp=2", "parallel.etp=1", "train.seq_length=63"], 2, "train.seq_length"),
    (["parallel.cp=2", "train.seq_length=66"], 2, "train.seq_length"),  # needs a multiple of 2*cp
    (["train.precision=fp16"], 1, "train.precision"),
    (["train.recompute=everything"], 1, "train.recompute"),
    (["train.eval_interval=-1"], 1, "train.eval_interval"),
    (["train.eval_steps=0"], 1, "train.eval_steps"),
    (["train.collective_timeout_s=0"], 1, "train.collective_timeout_s"),
    (["optim.lr=-0.1"], 1, "optim.lr"),
    (["optim.warmup_steps=100", "train.steps=10"], 1, "optim.warmup_steps"),
    (["moe.dispatch_wire=fp4"], 1, "moe.dispatch_wire"),
    (["moe.dispatcher=magic"], 1, "moe.dispatcher"),
    (["moe.score_function=relu"], 1, "moe.score_function"),
    (["moe.topk=9"], 1, "topk"),
    (["moe.capacity_factor=-1.0"], 1, "moe.capacity_factor"),
    (["checkpoint.load=/nonexistent/ckpt"], 1, "checkpoint.load"),
    (["checkpoint.save_interval=5"], 1, "checkpoint.save_interval"),  # without checkpoint.dir
    (["checkpoint.keep_last=0", "checkpoint.dir=/tmp/x"], 1, "checkpoint.keep_last"),
    (["logging.interval=0"], 1, "logging.interval"),
    (["logging.wandb.mode=sometimes"], 1, "logging.wandb.mode"),
    (["parallel.tp=3", "parallel.etp=1"], 3, "parallel.tp"),  # 8 heads not divisible by 3
    (["parallel.pp=3"], 3, "pp"),  # 4 layers over 3 stages
    # pipeline layouts (mixtral_tiny: 4 layers, no multi-token prediction)
    (["parallel.pp=2", "parallel.pipeline_layout='Et|ttL'"], 2, "parallel.pipeline_layout"),  # 3 layers of 4
    (["parallel.pp=2", "parallel.pipeline_layout='Et|tttmL'"], 2, "parallel.pipeline_layout"),  # m without MTP
    (["parallel.pp=2", "parallel.pipeline_layout='Et|t|t|tL'", "parallel.vpp=4"], 2, "parallel.pipeline_layout"),
    (["parallel.pp=2", "parallel.pipeline_layout='Ett|ttL'", "parallel.last_stage_layers=2"], 2, "pipeline_layout"),
    (["parallel.pp=2", "parallel.pipeline_layout='Et|t|t|tL'", "train.global_batch_size=6"], 2, "global_batch_size"),
    (["parallel.etp=2", "moe.ffn_hidden_size=95"], 2, "parallel.etp"),  # expert FFN not divisible
    (["model.num_kv_heads=3"], 1, "model.num_kv_heads"),
    (["moe.topk=0"], 1, "moe.topk"),
    (["data.weights=[1.0]"], 1, "data.weights"),
    # the recomputed experts would run outside the FP8 region delayed scaling needs
    (["train.recompute=moe", "moe.expert_backend=te", "moe.fp8_recipe=delayed"], 1, "train.recompute"),
    (["train.recompute_modules=[moe]", "moe.expert_backend=te", "moe.fp8_recipe=delayed"], 1, "train.recompute"),
    # recompute and offload modules: unknown names, full beside modules, a module the recompute empties,
    # the discarding / offloading of the compiled attention sublayer
    (["train.recompute_modules=[attention]"], 1, "train.recompute_modules"),
    (["train.recompute=full", "train.recompute_modules=[moe_act]"], 1, "train.recompute_modules"),
    (["train.recompute_modules=[layernorm]", "train.compile=true"], 1, "train.recompute_modules"),
    (["train.offload_modules=[router]"], 1, "train.offload_modules"),
    (["train.offload_modules=[qkv_linear]", "train.recompute_modules=[layernorm]"], 1, "train.offload_modules"),
    (["train.offload_modules=[expert_fc1]", "train.recompute=moe"], 1, "train.offload_modules"),
    (["train.offload_modules=[attn_norm]", "train.recompute=full"], 1, "train.offload_modules"),
    (["train.offload_modules=[core_attn]", "train.compile=true"], 1, "train.offload_modules"),
]


@pytest.mark.parametrize("overrides,world,setting", BAD, ids=lambda x: None)
def test_bad_config_names_the_setting(overrides, world, setting, monkeypatch):
    import torch.distributed as dist

    created = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: created.append(1))
    with pytest.raises(ConfigError) as err:
        validate_job(job(*overrides), world_size=world)
    assert setting in str(err.value), str(err.value)
    assert not created


@pytest.mark.parametrize(
    "override",
    ["model=no_such_model", "train.steps=abc", "moe.no_such_key=1", "parallel.tp=two", "train.no_such_key=1"],
)
def test_hydra_rejects_unknown_keys_and_types(override):
    from hydra.errors import HydraException

    with pytest.raises(HydraException) as err:
        compose_tree(override)
    assert override.split("=")[0].split(".")[-1] in str(err.value) or "no_such_model" in str(err.value)


def test_unknown_section_and_key_in_plain_dict():
    tree = compose_tree()
    with pytest.raises(ConfigError, match="trian"):
        job_config_from_dict({**tree, "trian": {}})
    with pytest.raises(ConfigError, match="train.stepz"):
        job_config_from_dict({**tree, "train": {**tree["train"], "stepz": 3}})
    with pytest.raises(ConfigError, match="model"):
        job_config_from_dict({k: v for k, v in tree.items() if k != "model"})
