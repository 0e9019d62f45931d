"""The aux loss's gradient on the router weights, through the trainer, equals transformers' own
``load_balancing_loss_func`` differentiated on the same routing (1 rank, and the README's layout:
4 ranks, attention TP2 DP2, MoE ETP1 EP4).

One optimizer step of a 2-layer Mixtral with ``moe.aux_loss_coeff=0.1``. The LM loss is given the
weight 0 (the trainer's ``loss_scale`` is patched to 0), so the router weights' reduced gradient (read
just before the AdamW update) is the aux loss's alone. The same step's weights are exported with
``to_hf`` and loaded in transformers' ``MixtralForCausalLM``; the same micro-batches (those of every DP
rank) go through it, and the reference objective is differentiated by autograd there.

The scale, exactly: the engine's loss of layer l on one micro-batch of T tokens is
``coeff·E/(k·T²)·Σ_e P_e·n_e`` (P_e: summed softmax probability, n_e: top-k count), and the trainer
weights it ``1/M`` (M: micro-batches of the global batch). transformers' function returns
``E·Σ_e (n_e/R)·(P_e/R)`` with R the rows of *all* the layers it is given, counts and probabilities
pooled over those layers, and no 1/k. So the reference calls it once per layer (a pooled call is not
the sum of the per-layer losses: the test checks that it differs) and multiplies by ``coeff/k/M``:
``Σ_m Σ_l coeff/(k·M) · load_balancing_loss_func((logits_lm,), E, k)``. Both sides include the
gradient that a later layer's aux loss sends to an earlier router through the hidden states.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist

from tests.optional import require

transformers = require("transformers")
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: E402

from folding.data.config import DataConfig  # noqa: E402
from folding.job.config import JobConfig, LoggingConfig, ParallelConfig, TrainConfig, WandbConfig  # noqa: E402
from folding.model.hf.weights import to_hf  # noqa: E402
from folding.model.presets import get_preset  # noqa: E402
from folding.moe.routing.balancing import find_routers  # noqa: E402
from folding.optim.config import OptimConfig  # noqa: E402

COEFF, GBS, MBS = 0.1, 8, 2


def _job(parallel, metrics_file):
    model = get_preset(
        "mixtral_tiny", hidden_size=32, num_layers=2, init_std=0.1, moe={"ffn_hidden_size": 16, "aux_loss_coeff": COEFF}
    )
    return JobConfig(
        model=model,
        parallel=ParallelConfig(**parallel),
        train=TrainConfig(steps=1, global_batch_size=GBS, micro_batch_size=MBS, seq_length=16, eval_interval=0),
        optim=OptimConfig(lr=1e-3, warmup_steps=0, decay_style="constant", distributed=False),
        data=DataConfig(),
        logging=LoggingConfig(metrics_file=metrics_file, console=False, wandb=WandbConfig(mode="disabled")),
    )


def _train_one_step(parallel, run_dir):
    """One trainer step with the LM loss weighted 0; returns this rank's DP rank, its micro-batches'
    tokens and the router weights' reduced gradients by layer (the model is exported to run_dir/hf)."""
    from folding.training import trainer

    job = _job(parallel, os.path.join(run_dir, "metrics.jsonl"))
    seen = {}
    real_run, real_step, real_build = trainer.run_microbatches, trainer._clip_and_step, trainer._build_chunks

    def build(job, ps, device, **kw):
        seen["chunks"] = real_build(job, ps, device, **kw)
        return seen["chunks"]

    def run(chunks, mbs, **kw):
        seen["tokens"] = [mb["tokens"].clone() for mb in mbs]
        return real_run(chunks, mbs, **{**kw, "loss_scale": 0.0})

    def step(optimizer, loss):
        optimizer.reduce_gradients()
        seen["grads"] = {r.layer_number: r.weight.main_grad.clone() for r in find_routers(seen["chunks"])}
        to_hf(seen["chunks"][0], os.path.join(run_dir, "hf"))  # the weights the gradients belong to
        return real_step(optimizer, loss)

    trainer.run_microbatches, trainer._clip_and_step, trainer._build_chunks = run, step, build
    try:
        trainer.train(job, run_dir=run_dir)
    finally:
        trainer.run_microbatches, trainer._clip_and_step, trainer._build_chunks = real_run, real_step, real_build
    dp_rank = trainer.dp_rank_of(job.layout(dist.get_world_size()), dist.get_rank())
    return dp_rank, seen["tokens"], seen["grads"]


def _reference(run_dir, tokens):
    """transformers' aux objective on ``tokens`` (every micro-batch of the global batch): its value and
    the gate weights' gradients by layer."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "hf"), torch_dtype=torch.float32)
    E, k = hf.config.num_local_experts, hf.config.num_experts_per_tok
    M = len(tokens)
    total = 0.0
    for ids in tokens:
        logits = hf(ids, output_router_logits=True).router_logits  # one [B·S, E] tensor per layer
        per_layer = [load_balancing_loss_func((lg,), E, k) for lg in logits]
        pooled = load_balancing_loss_func(tuple(logits), E, k)
        assert not torch.isclose(pooled, sum(per_layer) / len(per_layer), rtol=1e-3)  # pooling is not a mean
        objective = sum(COEFF / (k * M) * loss for loss in per_layer)
        objective.backward()
        total += objective.item()
    grads = {i: layer.mlp.gate.weight.grad for i, layer in enumerate(hf.model.layers)}
    return total, grads


@pytest.mark.parametrize("world,parallel", [(1, {}), (4, dict(tp=2, ep=4, etp=1))], ids=["1rank", "tp2_ep4"])
def test_aux_loss_gradient_matches_transformers(ranks, tmp_path, world, parallel):
    out = ranks(world).run(_train_one_step, parallel, str(tmp_path))
    by_dp = {}
    for dp_rank, tokens, _ in out:  # TP peers hold the same micro-batches
        assert torch.equal(torch.stack(by_dp.setdefault(dp_rank, tokens)), torch.stack(tokens))
    tokens = [t for d in sorted(by_dp) for t in by_dp[d]]
    assert len(tokens) == GBS // MBS
    value, ref = _reference(str(tmp_path), tokens)
    record = next(json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"train"' in line)
    assert record["aux_loss"] == pytest.approx(value, rel=1e-5)
    for rank, (_, _, grads) in enumerate(out):
        assert sorted(grads) == [0, 1]
        for layer, g in grads.items():
            assert ref[layer].abs().max() > 1e-4  # the aux loss does move the router
            torch.testing.assert_close(g, ref[layer], rtol=1e-4, atol=1e-7, msg=f"rank {rank} layer {layer}")
