"""``train.dry_run=true``: validate a job for its intended world size and print what each rank would hold.

Nothing is built: no model, no process group, no data. The report shows the folded layout, the
model's total and active parameters, the parameters of the heaviest pipeline stage per rank (dense
ones sharded over TP, expert ones over EP×ETP), and the per-rank memory estimate of the planning
package's memory model (params, grads, optimizer state, activations) when it is installed.

Usage::

    print(dry_run_report(job, world_size=128))
    python examples/pretrain_mixtral.py recipes=mixtral_8x22b train.dry_run=true
"""
from __future__ import annotations

from typing import Dict, List

from ..model.config import ModelConfig
from ..pipeline.partition import partition_layers
from .config import JobConfig
from .validate import validate_job

GIB = 2**30


def stage_parameters_per_rank(model: ModelConfig, *, tp: int, ep: int, etp: int, pp: int, vpp=None
                              ) -> List[Dict[str, int]]:
    """Parameters one rank of each pipeline rank holds: ``{"dense": n, "expert": n}`` per pipeline rank
    (embedding on the first, final norm and output layer on the last; tied weights counted once)."""
    H = model.hidden_size
    ranges = partition_layers(num_layers=model.num_layers, pp=pp, vpp=vpp)
    out = [{"dense": 0, "expert": 0} for _ in range(pp)]
    for v, (start, end) in enumerate(ranges):
        r = out[v % pp]
        for i in range(start, end):
            attn = model.attention_params()
            r["dense"] += (attn - H) // tp + 2 * H           # projections sharded, the two norms replicated
            if model.is_moe_layer(i):
                r["dense"] += model.num_experts * H + model.shared_expert_params() // tp
                r["expert"] += model.num_experts * model.expert_params() // (ep * etp)
            else:
                r["dense"] += 3 * H * model.ffn_hidden_size // tp
    out[0]["dense"] += model.vocab_size * H // tp
    if not model.tie_embeddings or pp > 1:
        out[-1]["dense"] += model.vocab_size * H // tp
    out[-1]["dense"] += H
    return out


def _memory_estimate(job: JobConfig, layout) -> Dict[str, float]:
    """Bytes by part on the worst stage, from the planning package's memory model."""
    from ..planning.planner import planner_memory_bytes
    from ..planning.step_time import Plan, TrainingShape
    plan = Plan(tp=layout.tp, cp=layout.cp, pp=layout.pp, vpp=layout.vpp or 1, ep=layout.ep, etp=layout.etp,
                dp=layout.dp, edp=layout.edp, distributed_optimizer=job.optim.distributed,
                recompute="selective" if job.train.recompute in ("selective", "moe") else job.train.recompute)
    shape = TrainingShape(seq_length=job.train.seq_length, global_batch_size=job.train.global_batch_size,
                          micro_batch_size=job.train.micro_batch_size)
    return planner_memory_bytes(job.model, plan, shape=shape)


def dry_run_report(job: JobConfig, *, world_size: int) -> str:
    """Validate ``job`` on ``world_size`` ranks (raises ``ConfigError``) and return the report text."""
    layout = validate_job(job, world_size=world_size)
    m, t = job.model, job.train
    total, active = m.num_parameters()
    M = t.global_batch_size // (t.micro_batch_size * layout.dp)
    lines = [f"dry run: {m.name} on {world_size} ranks",
             f"  layout      {layout.describe()}  (order {layout.order})",
             f"  batch       global {t.global_batch_size} x seq {t.seq_length}, micro-batch "
             f"{t.micro_batch_size}, {M} micro-batches per replica per step",
             f"  parameters  total {total / 1e9:.2f} B, active {active / 1e9:.2f} B per token",
             f"  moe         {job.moe.num_experts} experts, top-{job.moe.topk}, dispatcher {job.moe.dispatcher}, "
             f"capacity_factor {job.moe.capacity_factor}"]
    stages = stage_parameters_per_rank(m, tp=layout.tp, ep=layout.ep, etp=layout.etp, pp=layout.pp, vpp=layout.vpp)
    for r, s in enumerate(stages):
        lines.append(f"  stage {r:<4d}  per rank: dense {s['dense'] / 1e9:.3f} B + expert {s['expert'] / 1e9:.3f} B "
                     f"params")
    try:
        mem = _memory_estimate(job, layout)
    except ImportError:
        lines.append("  memory      (the planning memory model is not installed: no estimate)")
    else:
        parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in mem.items())
        lines.append(f"  memory      {sum(mem.values()) / GIB:.1f} GiB per rank on the worst stage ({parts} GiB; "
                     f"distributed optimizer {'on' if job.optim.distributed else 'off'})")
    return "\n".join(lines)
