"""Every ``MoEConfig`` field is a ``moe.*`` key that the loader accepts and that reaches the model's MoE
record; every key is documented in docs/routing.md's options table and every documented key exists;
``moe.topk`` reaches FLOPs, the memory model and the dry run."""

import dataclasses
import os
import re

import pytest

from folding.job.config import ConfigError, job_config_from_dict
from folding.job.schema import register_schema
from folding.launch import cli
from folding.model.presets import get_preset
from folding.moe.config import MoEConfig

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CONFIGS = os.path.join(ROOT, "configs")


def documented_moe_keys():
    text = open(os.path.join(ROOT, "docs", "routing.md"), encoding="utf-8").read()
    section = text.split("## Options (`moe.*`)", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {key for row in rows for key in re.findall(r"`([a-z_0-9]+)`", row.split("|")[1])}


MOE_FIELDS = [f.name for f in dataclasses.fields(MoEConfig)]

# one valid command-line value per MoEConfig field, with what it needs beside it (mixtral_tiny: E=8, k=2)
OVERRIDES = {
    "num_experts": ("16", []),
    "topk": ("4", []),
    "ffn_hidden_size": ("48", []),
    "score_function": ("sigmoid", []),
    "pre_softmax": ("true", []),
    "num_groups": ("2", ["moe.group_topk=1"]),
    "group_topk": ("1", ["moe.num_groups=2"]),
    "group_score_topk": ("2", ["moe.num_groups=2", "moe.group_topk=1"]),
    "topk_scaling_factor": ("2.5", []),
    "router_dtype": ("fp64", []),
    "input_jitter_eps": ("0.01", []),
    "capacity_factor": ("1.5", []),
    "drop_policy": ("position", ["moe.capacity_factor=1.0"]),
    "pad_to_capacity": ("true", ["moe.capacity_factor=1.0"]),
    "aux_loss_type": ("seq_aux_loss", []),
    "aux_loss_coeff": ("0.5", []),
    "z_loss_coeff": ("0.001", []),
    "expert_bias": ("true", []),
    "expert_bias_update_rate": ("0.01", ["moe.expert_bias=true"]),
    "force_balance": ("true", []),
    "dispatcher": ("allgather", []),
    "dispatch_wire": ("mxfp8", []),
    "combine_wire": ("fp8", []),
    "grad_wire": ("fp8", []),
    "expert_backend": ("loop", []),
    "fp8_recipe": ("mxfp8", ["moe.expert_backend=emulated"]),
    "fp8_act_input_store": ("true", ["moe.fp8_recipe=mxfp8", "moe.expert_backend=emulated"]),
    "shared_expert_ffn_hidden_size": ("32", []),
    "shared_expert_gate": ("true", ["moe.shared_expert_ffn_hidden_size=32"]),
    "trace_dir": ("traces", []),
    "expert_replicas": ("2", []),
    "replica_interval": ("10", ["moe.expert_replicas=2"]),
}


def test_docs_table_and_schema_agree():
    documented = documented_moe_keys()
    assert documented == set(MOE_FIELDS), (sorted(documented - set(MOE_FIELDS)), sorted(set(MOE_FIELDS) - documented))
    assert {f"moe.{k}" for k in MOE_FIELDS} <= set(cli.schema_keys())  # the schema is generated from MoEConfig
    assert set(OVERRIDES) == set(MOE_FIELDS)  # a new field needs a row here (and in the docs)


@pytest.mark.parametrize("key", MOE_FIELDS)
def test_every_moe_field_is_settable_and_reaches_the_model(key):
    register_schema()
    value, extra = OVERRIDES[key]
    tree = cli.compose_tree([f"moe.{key}={value}", *extra], config_dir=CONFIGS, config_name="config")
    job = job_config_from_dict(tree)
    got = getattr(job.model.moe, key)
    assert str(got).lower() == value or got == type(got)(value)
    assert job.moe is job.model.moe  # one record
    assert got != getattr(get_preset("mixtral_tiny").moe, key)  # the override really changed it


def test_model_section_does_not_take_moe_keys():
    register_schema()
    assert cli.unknown_key(["model.num_experts=16"]) == "model.num_experts: unknown key; did you mean moe.num_experts?"
    assert "did you mean moe.ffn_hidden_size?" in cli.unknown_key(["model.moe_ffn_hidden_size=16"])
    with pytest.raises(ConfigError, match="moe.topk=9: exceeds moe.num_experts=8"):
        job_config_from_dict(cli.compose_tree(["moe.topk=9"], config_dir=CONFIGS, config_name="config"))


def test_moe_topk_reaches_the_model_flops_and_dry_run_memory():
    register_schema()
    from folding.job.validate import validate_job
    from folding.launch.dry_run import memory_estimate
    from folding.planning.flops import flops_per_token

    jobs = {
        k: job_config_from_dict(
            cli.compose_tree(["recipes=qwen2_57b_a14b", f"moe.topk={k}"], config_dir=CONFIGS, config_name="config")
        )
        for k in (4, 8)
    }
    assert jobs[4].model.moe.topk == 4 and jobs[8].model.moe.topk == 8
    assert jobs[4].model.num_parameters()[1] < jobs[8].model.num_parameters()[1]  # active params
    assert flops_per_token(jobs[4].model, 4096).model_training < flops_per_token(jobs[8].model, 4096).model_training
    mem = {k: memory_estimate(j, validate_job(j, world_size=64)).total for k, j in jobs.items()}
    assert mem[4] < mem[8]
    from folding.launch.dry_run import dry_run_report

    flops_line = {
        k: next(line for line in dry_run_report(j, world_size=64).splitlines() if "GFLOP" in line)
        for k, j in jobs.items()
    }
    assert "66.2 GFLOP" in flops_line[4] and "84.7 GFLOP" in flops_line[8]  # 3x forward: top-4 vs top-8
