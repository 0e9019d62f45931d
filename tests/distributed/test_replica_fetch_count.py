"""Replica weights are fetched once per optimizer step per MoE layer, and their gradients returned once.

Tiny Mixtral (4 MoE layers) trains 2 steps on 4 gloo ranks through the real training loop with
``moe.expert_replicas=1`` re-planned every step, so step 2 runs with replicas. Inside each rank
the test counts, per step and per MoE layer that ran with a non-empty slot table:

- the fetches: the distinct storages of the replica weights the layer computed with (every fetch
  fills new tensors; each one seen is kept alive, so no storage is reused and counted once);
- the exchanges of the replica module (every ``all_to_all_single`` it issues: fetches and returns).

Whatever the number of micro-batches (1 or 4 per rank), with recompute (``full``, ``moe``), with a
pipeline (PP2 EP2) and with ``parallel.overlap_moe_comm`` and ``parallel.delay_wgrad`` (merged
pairs, deferred weight gradients), each such layer fetches exactly once per step and exchanges
exactly twice (one fetch, one return of the gradients).
"""

import collections
import sys

import pytest
import torch.distributed as dist

from folding.data.config import DataConfig
from folding.job.config import JobConfig, LoggingConfig, ParallelConfig, TrainConfig, WandbConfig
from folding.model.presets import get_preset
from folding.optim.config import OptimConfig
from folding.parallel import build_parallel_state

STEPS = 2


def _job(parallel, train):
    model = get_preset(
        "mixtral_tiny", hidden_size=32, moe=dict(ffn_hidden_size=16, expert_replicas=1, replica_interval=1)
    )
    return JobConfig(
        model=model,
        parallel=ParallelConfig(**parallel),
        train=TrainConfig(
            **{**dict(steps=STEPS, global_batch_size=8, micro_batch_size=2, seq_length=16, eval_interval=0), **train}
        ),
        optim=OptimConfig(lr=3e-3, warmup_steps=1, distributed=True),
        data=DataConfig(),
        logging=LoggingConfig(metrics_file="metrics.jsonl", console=False, wandb=WandbConfig(mode="disabled")),
    )


def _count(parallel, train, run_dir):
    """Train; per step ``{layer: [fetches, exchanges]}`` of the layers that ran with a slot table."""
    from folding.moe.layer import MoELayer
    from folding.moe.replicas import fetch as replica_fetch
    from folding.training import trainer

    step = [0]
    kept = []  # every replica weight seen, alive to the end: no storage is freed and reused
    storages = collections.defaultdict(set)  # (step, layer) -> distinct storages of its replica weights
    exchanges = collections.Counter()  # step -> the replica module's all-to-alls
    real_a2a, real_run, real_weights = dist.all_to_all_single, trainer.run_microbatches, MoELayer._replica_weights

    def a2a(*args, **kwargs):
        if sys._getframe(1).f_globals is vars(replica_fetch):
            exchanges[step[0]] += 1
        return real_a2a(*args, **kwargs)

    def run_microbatches(*args, **kwargs):
        step[0] += 1
        return real_run(*args, **kwargs)

    def replica_weights(layer, geo):
        out = real_weights(layer, geo)
        if any(e >= 0 for e in layer.replica_table):
            kept.append(out[0].detach())
            storages[(step[0], layer.layer_number)].add(out[0].untyped_storage().data_ptr())
        return out

    dist.all_to_all_single, trainer.run_microbatches, MoELayer._replica_weights = a2a, run_microbatches, replica_weights
    job = _job(parallel, train)
    ps = build_parallel_state(job.layout(dist.get_world_size()))
    try:
        trainer.train(job, run_dir=run_dir, parallel_state=ps)
    finally:
        dist.all_to_all_single, trainer.run_microbatches, MoELayer._replica_weights = real_a2a, real_run, real_weights
        ps.destroy()
    out = {}
    for (s, layer), ptrs in sorted(storages.items()):
        out.setdefault(s, {})[layer] = [len(ptrs), 0]
    for s, n in exchanges.items():
        out.setdefault(s, {})["exchanges"] = n
    return out


CASES = {  # id: (parallel, train) on 4 ranks
    "ep4-1mb": (dict(ep=4), {}),
    "ep4-4mb": (dict(ep=4), dict(global_batch_size=32)),
    "ep4-4mb-full-recompute": (dict(ep=4), dict(global_batch_size=32, recompute="full")),
    "pp2ep2-4mb-moe-recompute": (dict(pp=2, ep=2), dict(global_batch_size=16, recompute="moe")),
    "ep4-4mb-overlap-delay-wgrad": (dict(ep=4, overlap_moe_comm=True, delay_wgrad=True), dict(global_batch_size=32)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_replicas_fetched_once_per_step(ranks, tmp_path, case):
    parallel, train = CASES[case]
    results = ranks(4).run(_count, parallel, train, str(tmp_path))
    with_table = 0
    for rank, per_step in enumerate(results):
        for s in range(1, STEPS + 1):
            layers = {k: v for k, v in per_step.get(s, {}).items() if k != "exchanges"}
            fetches = {layer: n for layer, (n, _) in layers.items()}
            assert all(n == 1 for n in fetches.values()), (case, rank, s, fetches)
            # one fetch and one return of the gradients per layer that ran with replicas
            assert per_step.get(s, {}).get("exchanges", 0) == 2 * len(layers), (case, rank, s, per_step.get(s))
            with_table += len(layers)
    assert with_table > 0, "no layer ran with a replica slot table: the test would be vacuous"
