"""``model=from_hf checkpoint.init_from_hf=DIR`` takes the architecture from ``DIR/config.json``: a tiny
random Qwen2-MoE and a tiny Mixtral of shapes no preset has train on 1 rank and on 4 ranks (TP2 EP2)
with equal first-step losses, with no ``model.*`` override; an override that contradicts the source is
refused, a training option applies, and ``model=from_hf`` without a source names the setting."""

import json
import os
import subprocess
import sys

import pytest

from folding.job.config import ConfigError, job_config_from_dict
from folding.job.schema import from_hf_node
from folding.launch.model_from_hf import resolve_from_hf
from tests.optional import require

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "pretrain_mixtral.py")
COMMON = ["model=from_hf", "checkpoint.init_from_hf=src", "train.seq_length=32", "train.steps=1"]
COMMON += ["train.global_batch_size=8", "train.micro_batch_size=1", "train.eval_interval=0"]
COMMON += ["logging.wandb.mode=disabled"]


def _source(family, path):
    transformers = require("transformers")
    import torch

    shape = dict(vocab_size=300, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2)
    if family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            **shape, intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=40,
            num_experts=6, num_experts_per_tok=2, max_position_embeddings=256, norm_topk_prob=False,
        )  # fmt: skip
        model = transformers.Qwen2MoeForCausalLM(cfg)
    else:
        cfg = transformers.MixtralConfig(
            **shape, intermediate_size=24, num_local_experts=6, num_experts_per_tok=2, max_position_embeddings=256
        )
        model = transformers.MixtralForCausalLM(cfg)
    torch.manual_seed(0)
    model.save_pretrained(path)


def _first_loss(cwd, run_dir):
    recs = [json.loads(line) for line in open(os.path.join(cwd, run_dir, "metrics.jsonl"))]
    return [r["lm_loss"] for r in recs if r["kind"] == "train"][0]


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_from_hf_trains_alike_on_1_and_4_ranks(family, tmp_path):
    _source(family, str(tmp_path / "src"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    one = subprocess.run(
        [sys.executable, SCRIPT, *COMMON, "hydra.run.dir=r1"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    four = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", SCRIPT, *COMMON]
        + ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1", "hydra.run.dir=r4"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert four.returncode == 0, four.stdout[-3000:] + four.stderr[-3000:]
    assert "MoE ETP1 EP2 EDP2" in four.stdout
    a, b = _first_loss(tmp_path, "r1"), _first_loss(tmp_path, "r4")
    assert abs(a - b) <= 1e-5 * abs(a), (a, b)


def test_overrides_on_top_of_the_source(tmp_path):
    _source("mixtral", str(tmp_path / "src"))
    node = from_hf_node()
    tree = {**node, "checkpoint": {"init_from_hf": str(tmp_path / "src")}}
    # the source's own balancing loss, though save_pretrained wrote output_router_logits=false; the start
    # says where it came from
    source = json.load(open(tmp_path / "src" / "config.json"))
    assert source["output_router_logits"] is False and source["router_aux_loss_coef"] > 0
    plain = job_config_from_dict(resolve_from_hf(tree))
    assert plain.model.moe.aux_loss_coeff == source["router_aux_loss_coef"]
    assert [n for n in plain.notes if n.startswith("moe.aux_loss_coeff")] == [
        f"moe.aux_loss_coeff: {source['router_aux_loss_coef']} (router_aux_loss_coef of {tmp_path / 'src'}"
        "/config.json; its output_router_logits=false only says whether transformers returns router logits)"
    ]
    job = job_config_from_dict(resolve_from_hf({**tree, "moe": {**node["moe"], "aux_loss_coeff": 0.123}}))
    coeff = source["router_aux_loss_coef"]
    assert [n for n in job.notes if n.startswith("moe.aux_loss_coeff")] == [
        f"moe.aux_loss_coeff: 0.123 (command line; the source's router_aux_loss_coef is {coeff})"
    ]
    assert (job.model.hidden_size, job.model.moe.num_experts, job.model.max_position_embeddings) == (48, 6, 256)
    assert job.model.moe.aux_loss_coeff == 0.123  # a training option given on the command line applies
    from folding.checkpoint.from_hf import check_init_source

    # (an override equal to the placeholder preset's value could not be told from no override: 96 is not)
    wider = job_config_from_dict(resolve_from_hf({**tree, "model": {**node["model"], "hidden_size": 96}}))
    with pytest.raises(ConfigError, match="model.hidden_size: source 48, this job 96"):
        check_init_source(str(tmp_path / "src"), wider.model)
    with pytest.raises(ConfigError, match="model=from_hf takes the architecture from checkpoint.init_from_hf"):
        resolve_from_hf(node)
