"""Every ``moe.*`` key the loader accepts is documented in docs/routing.md's options table, every key
documented there is accepted, and ``moe.topk`` reaches the model config that FLOPs, the memory model,
the dry run and the planner read."""

import dataclasses
import os
import re

import pytest

from folding.moe.config import MoEConfig
from folding.training import cli
from folding.training.config import MOE_MODEL_KEYS, MOE_OVERRIDE_KEYS, job_config_from_dict
from folding.training.schema import register_schema

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CONFIGS = os.path.join(ROOT, "configs")


def documented_moe_keys():
    text = open(os.path.join(ROOT, "docs", "routing.md"), encoding="utf-8").read()
    section = text.split("## Options (`moe.*`)", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {key for row in rows for key in re.findall(r"`([a-z_0-9]+)`", row.split("|")[1])}


def test_docs_table_and_schema_agree():
    documented = documented_moe_keys()
    assert documented == set(MOE_OVERRIDE_KEYS), (
        sorted(documented - set(MOE_OVERRIDE_KEYS)),
        sorted(set(MOE_OVERRIDE_KEYS) - documented),
    )
    fields = {f.name for f in dataclasses.fields(MoEConfig)}
    assert set(MOE_OVERRIDE_KEYS) | set(MOE_MODEL_KEYS) == fields  # nothing unreachable
    assert {f"moe.{k}" for k in MOE_OVERRIDE_KEYS} <= set(cli.schema_keys())


@pytest.mark.parametrize(
    "override",
    [
        "moe.router_dtype=fp64",
        "moe.num_groups=2",
        "moe.group_topk=1",
        "moe.input_jitter_eps=0.01",
        "moe.topk_scaling_factor=2.5",
        "moe.expert_bias_update_rate=0.01",
        "moe.force_balance=true",
    ],
)
def test_documented_keys_are_accepted(override):
    register_schema()
    key, value = override.split("=")
    extra = (
        ["moe.group_topk=1"]
        if key == "moe.num_groups"
        else ["moe.num_groups=2"]
        if key == "moe.group_topk"
        else ["moe.expert_bias=true"]
        if key == "moe.expert_bias_update_rate"
        else []
    )
    tree = cli.compose_tree([override, *extra], config_dir=CONFIGS, config_name="config")
    job = job_config_from_dict(tree)
    got = getattr(job.moe, key.split(".")[1])
    assert str(got).lower() == value or got == type(got)(value)


def test_moe_topk_reaches_the_model_flops_and_dry_run_memory():
    register_schema()
    from folding.planning.flops import flops_per_token
    from folding.training.dry_run import memory_estimate
    from folding.training.validate import validate_job

    jobs = {
        k: job_config_from_dict(
            cli.compose_tree(["recipes=qwen2_57b_a14b", f"moe.topk={k}"], config_dir=CONFIGS, config_name="config")
        )
        for k in (4, 8)
    }
    assert jobs[4].model.topk == 4 and jobs[8].model.topk == 8
    assert jobs[4].model.num_parameters()[1] < jobs[8].model.num_parameters()[1]  # active params
    assert flops_per_token(jobs[4].model, 4096).model_training < flops_per_token(jobs[8].model, 4096).model_training
    mem = {k: memory_estimate(j, validate_job(j, world_size=64)).total for k, j in jobs.items()}
    assert mem[4] < mem[8]
