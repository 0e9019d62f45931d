"""``train.dry_run=true``: validate a job for its intended world size and print what each rank would hold.

Nothing is built: no model, no process group, no samples. The data are checked as the real start checks
them (:func:`folding.data.check.open_data`: the files of ``data.paths`` exist and hold token ids of the
tokenizer, and every split with a non-zero weight in ``data.split`` gets documents), so a job the dry run
accepts is one whose start does not stop on its data; the ``data`` line says what each split gets. The
report shows the folded layout, the
model's total and active parameters, what each pipeline rank's virtual stages hold (in the symbols of
``parallel.pipeline_layout``: ``E`` embedding, ``t`` per transformer layer, ``m`` multi-token prediction,
``L`` loss; ``-`` an empty stage) and its layer count, the parameters one rank of each pipeline stage holds
(dense ones sharded over TP, expert ones over EP×ETP; the multi-token-prediction modules on the last stage), and the
per-rank memory estimate of the one memory model,
:func:`folding.planning.memory.memory_per_rank` (params, grads, optimizer state, activations,
transients; the same call the layout planner makes), with ``parallel.overlap_moe_comm`` the one more
micro-batch of one model chunk in flight that it costs (:func:`folding.planning.moe_overlap.memory_with_overlap`).
It also says which expert backend runs the job on the machine the dry run is on, or why it cannot
(a report, not an error: the job may be meant for other machines), and the precision the estimate assumes
(parameters, activations, gradients, master weights, optimizer state).

The job's memory is checked against ``parallel.gpu`` (else this machine's CUDA device, else nothing:
:mod:`folding.launch.device_memory`): a job whose predicted peak on some pipeline stage does not fit is
refused with a :class:`~folding.job.config.ConfigError` naming the stages, their peaks, the GPU's memory and
what would lower them, so the entry point prints one ``error:`` line and exits with status 2.

Usage::

    print(dry_run_report(job, world_size=128))
    python examples/pretrain_mixtral.py recipes=mixtral_8x22b train.dry_run=true
    python examples/pretrain_mixtral.py recipes=mixtral_8x22b parallel.gpu=h100 train.dry_run=true
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List

from ..data.check import open_data
from ..job.config import ConfigError, JobConfig
from ..job.machine import check_experts_here, training_device
from ..job.validate import validate_job
from ..model.config import ModelConfig
from ..parallel.partition import layout_stages
from ..parallel.pipeline_layout import compact_stage, stage_symbols
from ..parallel.rank_math import expert_generator
from ..planning.flops import flops_per_token
from ..planning.job_memory import job_memory, job_precision, stage_memories
from ..planning.memory import MemoryEstimate, adamw_share, param_counts, state_bytes_per_param
from ..planning.node_dispatch import exchange_rows
from ..planning.optim_precision import OptimizerPrecision
from .device_memory import check_memory_fits, device_line, job_gpu

GIB = 2**30


def stage_parameters_per_rank(model: ModelConfig, layout) -> List[Dict[str, int]]:
    """Parameters one rank of each pipeline rank holds under ``layout``: ``{"dense": n, "expert": n}`` per
    pipeline rank (embedding on the first, final norm and output layer on the last; tied weights counted
    once; the multi-token-prediction modules, and with PP > 1 an untied embedding's copy, on the last), from
    the planning memory model's :func:`~folding.planning.memory.param_counts`."""
    counts = [param_counts(model, layout, stage=r) for r in range(layout.pp)]
    return [{"dense": c.dense, "expert": c.expert} for c in counts]


def stage_contents(model: ModelConfig, layout) -> List[str]:
    """What each pipeline rank's virtual stages hold, one string per rank in layout symbols, chunk by chunk:
    ``Et|tt|tt|tt: 7 layers`` (long runs as ``t*6``, an empty stage as ``-``), from the one partition
    (:func:`folding.parallel.partition.partition_layers`: ``parallel.pipeline_layout`` or the split)."""
    ranges = layout_stages(layout, num_layers=model.num_layers, mtp_num_layers=model.mtp_num_layers)
    symbols = stage_symbols(ranges, mtp_num_layers=model.mtp_num_layers)
    out = []
    for r in range(layout.pp):
        mine = symbols[r :: layout.pp]
        n = sum(s.count("t") for s in mine)
        out.append(f"{'|'.join(compact_stage(s) for s in mine)}: {n} layer{'' if n == 1 else 's'}")
    return out


def memory_estimate(job: JobConfig, layout) -> MemoryEstimate:
    """Bytes per rank on the worst pipeline stage: :func:`folding.planning.job_memory.job_memory`, the
    memory model with the job's precision, optimizer, recompute mode, sequence, micro-batch and micro-batch
    count (the experts' activations as the engine keeps them: 3 ``F``-wide tensors per routed row); with
    ``parallel.overlap_moe_comm`` the activations its longer warm-up keeps in flight per pipeline rank."""
    return job_memory(job, layout)


def optimizer_line(job: JobConfig) -> str:
    """The optimizer's state dtypes and its bytes per parameter element (unsharded; ZeRO-1 divides
    them by DP×CP / EDP), with the same for fp32, bf16 and fp8 moments and for Muon for comparison.
    Muon's figure is the model's average: one fp32 momentum (plus any master copy) for the hidden
    matrices, this run's AdamW state for the rest (``ParamCounts.adamw`` on one rank)."""
    width = 2 if job.train.precision == "bf16" else 4
    prec = OptimizerPrecision.of(job.optim)
    share = adamw_share(job.model)
    muon_avg = state_bytes_per_param(job.model, dataclasses.replace(prec, name="muon"), param_bytes=width)
    alt = ", ".join(
        f"{d} {dataclasses.replace(prec, exp_avg_dtype=d, exp_avg_sq_dtype=d).state_bytes(width):.2f}"
        for d in ("fp32", "bf16", "fp8")
    )
    alt += f"; Muon {muon_avg:.2f}"
    if prec.name == "muon":
        head = (
            f"Muon for the hidden matrices ({100 * (1 - share):.2f}% of the parameters: fp32 momentum, "
            f"{prec.muon_state_bytes(width):.2f} bytes), AdamW for the rest ({prec.describe()}, "
            f"{prec.state_bytes(width):.2f} bytes): {muon_avg:.2f}"
        )
    else:
        head = f"AdamW, {prec.describe()}: {prec.state_bytes(width):.2f}"
    return (
        f"  optimizer   {head} bytes of state per parameter (moments in fp32 / bf16 / fp8: {alt}), "
        f"gradients {prec.grad_bytes()} bytes"
    )


def dispatch_line(job: JobConfig, layout, world_size: int) -> str:
    """The rows a token sends per EP exchange over each link class, expected under uniform routing (the
    planner's model, :func:`folding.planning.node_dispatch.exchange_rows`), for ``moe.dispatcher`` (the
    ``allgather`` dispatcher counted as ``alltoall``) and the nodes the first EP group spans
    (``parallel.nvlink_domain``)."""
    G = job.parallel.resolved_nvlink_domain(world_size)
    ep_ranks = expert_generator(layout).get_ranks("ep")[0]
    nodes = len({r // G for r in ep_ranks})
    kind = "hierarchical" if job.moe.dispatcher == "hierarchical" else "alltoall"
    rows = exchange_rows(
        num_experts=job.moe.num_experts,
        topk=job.moe.topk,
        ep=len(ep_ranks),
        ranks_per_node=len(ep_ranks) // nodes,
        dispatcher=kind,
        num_groups=job.moe.num_groups,
        group_topk=job.moe.group_topk,
    )
    return (
        f"  dispatch    EP{len(ep_ranks)} spans {nodes} node{'' if nodes == 1 else 's'} of {G} ranks "
        f"(parallel.nvlink_domain); per token and exchange, expected with uniform routing: {rows.nic:.2f} rows "
        f"across nodes, {rows.nvlink:.2f} inside a node ({kind})"
    )


def dry_run_report(job: JobConfig, *, world_size: int) -> str:
    """Validate ``job`` on ``world_size`` ranks and check its data (raises ``ConfigError``); return the report
    text."""
    layout = validate_job(job, world_size=world_size)
    try:
        data = open_data(job.data, model_vocab_size=job.model.vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    m, t = job.model, job.train
    total, active = m.num_parameters()
    M = t.global_batch_size // (t.micro_batch_size * layout.dp)
    lines = [
        f"dry run: {m.name} on {world_size} rank{'' if world_size == 1 else 's'}",
        f"  layout      {layout.describe()}  (order {layout.order})",
        f"  batch       global {t.global_batch_size} x seq {t.seq_length}, micro-batch "
        f"{t.micro_batch_size}, {M} micro-batches per replica per step",
        f"  data        {data.describe()} (data.split={job.data.split})",
        f"  parameters  total {total / 1e9:.2f} B, active {active / 1e9:.2f} B per token",
        f"  moe         {job.moe.num_experts} experts, top-{job.moe.topk}, dispatcher {job.moe.dispatcher}, "
        f"capacity_factor {job.moe.capacity_factor}",
        dispatch_line(job, layout, world_size),
        f"  flops       {flops_per_token(m, t.seq_length).model_training / 1e9:.1f} GFLOP per trained token "
        "(model FLOPs: the MFU numerator)",
    ]
    if m.mtp_num_layers:
        lines.append(
            f"  mtp         {m.mtp_num_layers} multi-token-prediction module(s) on the last stage, loss weight "
            f"{m.mtp_loss_scaling_factor} (in the counts above and below)"
        )
    try:
        here = f"runs {check_experts_here(job)}"
    except ConfigError as e:
        here = f"cannot run: {e}"
    lines.append(
        f"  experts     moe.expert_backend={job.moe.expert_backend}, moe.fp8_recipe={job.moe.fp8_recipe}; "
        f"on this machine ({training_device()}) it {here}"
    )
    gpu, source = job_gpu(job)
    per_stage = stage_memories(job, layout)
    check_memory_fits(job, layout, gpu, source, per_stage)
    stages = stage_parameters_per_rank(m, layout)
    held = stage_contents(m, layout)
    width = max(len(h) for h in held)
    for r, s in enumerate(stages):
        lines.append(
            f"  stage {r:<4d}  {held[r]:<{width}}  per rank: dense {s['dense'] / 1e9:.3f} B + expert "
            f"{s['expert'] / 1e9:.3f} B params"
        )
    lines.append(f"  precision   {job_precision(job)} (train.precision={t.precision}, optim.*)")
    lines.append(optimizer_line(job))
    mem = max(per_stage, key=lambda e: e.total)
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in mem.by_part().items())
    lines.append(
        f"  memory      {mem.total / GIB:.1f} GiB per rank on stage {mem.stage} ({parts} GiB; "
        f"distributed optimizer {'on' if job.optim.distributed else 'off'}, recompute {t.recompute_setting()}"
        + (
            f", offload {t.offload_setting()}: {mem.host / GIB:.1f} GiB of pinned host memory per rank"
            if t.offload_modules
            else ""
        )
        + (
            ", MoE exchanges overlapped: the longer warm-up's activations in flight"
            if job.parallel.overlap_moe_comm
            else ""
        )
        + ")"
    )
    lines.append(device_line(gpu, source, mem))
    return "\n".join(lines)
