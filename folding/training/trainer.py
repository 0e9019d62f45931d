"""The training loop: one optimizer step per global batch, metrics, evaluation, NaN/Inf skipping.

:func:`prepare` does everything that can fail on bad input (config checks, the layout, opening the
data) without any process group; :func:`train` runs the loop on an initialized ``torch.distributed``
world (:mod:`folding.launch.run` creates it; tests call :func:`train` inside their rank pool).

One step (1-based: step k is reported after the k-th optimizer update) runs these phases
(:func:`_train_step`):

1. data (:func:`_read_batch`): this DP rank's ``M = global_batch / (micro_batch · DP)`` micro-batches,
   and the global count N of unmasked tokens (their loss-mask sums all-reduced over DP), known
   before any backward;
2. forward-backward schedule (:func:`_forward_backward`): each micro-batch with loss
   ``masked_sum / N`` (gradients then *sum* over DP×CP and EDP in the optimizer);
3. reductions (:func:`_reduce`): one world all-reduce of [LM loss sum, expert counts, dropped
   pairs, router losses, stop flag, whether this rank still writes an asynchronous save]; with
   ``moe.trace_dir``, before it, a gather of every rank's per-expert counts and drops on rank 0,
   which appends them to the routing trace (:mod:`folding.training.telemetry.trace_record`);
4. clip and step (:func:`_clip_and_step`): if the loss or the gradient norm is NaN/Inf the update is
   skipped (logged ``skipped: true``), the data and the LR schedule still advance;
5. router updates (:func:`_update_routers`): the expert biases move (not after a skipped update) and
   the ``global_aux_loss`` counts restart, for every router the model holds
   (:class:`folding.moe.routing.balancing.BalancingRouter`);
6. metrics (:func:`_train_record`): rank 0 writes the ``train`` record, and a ``warning`` record
   when a layer's router has sent more than 90% of its tokens to one expert for 5 steps running
   (:mod:`folding.training.telemetry.collapse`); every ``train.eval_interval`` steps an ``eval`` record
   (:func:`folding.training.step_duties.evaluate_if_due`);
7. checkpoint (:func:`folding.training.step_duties.checkpoint_if_due`): with ``checkpoint.dir`` set, every
   ``checkpoint.save_interval`` steps, at the last step, and after a SIGTERM/SIGINT (seen by every
   rank through the step's all-reduce), after which the loop stops. With ``checkpoint.async_save``
   the write goes on behind the next steps (:mod:`folding.checkpoint.async_save`) and the save
   is published at the first step boundary where every rank's write has finished.

A run with a checkpoint to resume from (:func:`prepare` picks it: ``checkpoint.load``, or the
latest complete one in ``checkpoint.dir``) loads it after building the model and continues from
its step to ``train.steps``, in whatever layout this run has. Without one, ``checkpoint.init_from_hf``
or ``checkpoint.init_from_megatron`` starts the run at step 0 from those weights instead of a random
initialization (:mod:`folding.checkpoint.from_hf`, :mod:`folding.checkpoint.from_megatron`).

Usage::

    prep = prepare(job, world_size=dist.get_world_size(), rank=dist.get_rank())
    summary = train(job, run_dir=run_dir, prepared=prep)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.async_save import AsyncSaver
from ..checkpoint.from_hf import check_init_source, load_initial_weights, read_hf_source_config
from ..checkpoint.from_megatron import check_init_megatron, load_megatron_weights
from ..checkpoint.load import check_compatible, load_checkpoint, read_meta, resolve_resume
from ..data.build import build_data
from ..job.config import JobConfig
from ..job.machine import check_experts_here, compute_dtype, training_device
from ..job.validate import validate_job
from ..model.chunks import build_stage_chunks
from ..moe.layer import MoELayer
from ..moe.replicas.table import ReplicaSchedule
from ..moe.settings import LayerSettings
from ..optim.expert_bias import update_expert_biases
from ..optim.optimizer import FoldedOptimizer
from ..overlap.runtime import OverlapRuntime
from ..parallel import ParallelLayout, build_parallel_state
from ..parallel.params import materialize
from ..pipeline.stage import run_microbatches
from .evaluate import global_token_count
from .faults import StopRequest
from .metrics import MetricsSink, StepTimer, expert_load_summary
from .step_duties import checkpoint_if_due, evaluate_if_due, published, report_stop
from .telemetry.collapse import CollapseWatch
from .telemetry.moe_stats import LOSS_NAMES, MoEStats
from .telemetry.replica_log import replan_message
from .telemetry.trace_record import RoutingTracer, check_trace_dir
from .throughput import Throughput


@dataclasses.dataclass
class Prepared:
    """What :func:`prepare` checked and opened before any process group exists."""

    layout: ParallelLayout
    """The validated layout."""
    data: Any
    """This rank's :class:`folding.data.build.Data` (train / valid iterators)."""
    dp_rank: int
    """This rank's attention data-parallel rank (from the pure rank math)."""
    resume: Optional[str] = None
    """The checkpoint to resume from (checked against the model), or ``None``."""
    resume_run_dir: Optional[str] = None
    """The run directory that wrote ``resume`` (from its metadata), or ``None``."""
    expert_backend: str = ""
    """The expert backend that runs on this machine (``moe.expert_backend`` resolved, checked)."""
    init_from_hf: Optional[str] = None
    """The weights to start from (``checkpoint.init_from_hf``, checked against the model) when there
    is no checkpoint to resume from; ``None`` otherwise."""
    hf_source_config: Optional[Dict[str, Any]] = None
    """The ``config.json`` of the Hugging Face weights this run started from (read at a fresh start,
    carried in every checkpoint's metadata): the export writes its fields the engine does not model."""
    init_from_megatron: Optional[str] = None
    """The Megatron-Core checkpoint to start from (``checkpoint.init_from_megatron``, checked against the
    model: its ``iter_<N>`` store) when there is no checkpoint to resume from; ``None`` otherwise."""


def dp_rank_of(layout: ParallelLayout, rank: int) -> int:
    """Attention DP rank of global ``rank`` under ``layout`` (pure rank math, no process group)."""
    for group in layout.groups()["attention"]["dp"]:
        if rank in group:
            return group.index(rank)
    raise ValueError(f"rank {rank} is outside the layout's world of {layout.world_size}")


def prepare(job: JobConfig, *, world_size: int, rank: int) -> Prepared:
    """Validate ``job`` for ``world_size`` ranks and open this rank's data; no collective, no writes
    except the data cache. Raises :class:`ConfigError` (or the data module's ``ValueError``). The
    checks that depend on the expert backend see what it resolves to on :func:`training_device`."""
    layout = validate_job(job, world_size=world_size, device=training_device())
    expert_backend = check_experts_here(job)  # this machine can run the experts' backend and recipe
    resume = resume_run_dir = hf_source = None
    if job.checkpoint.dir or job.checkpoint.load:
        resume = resolve_resume(job.checkpoint)
        if resume is not None:
            meta = read_meta(resume)
            meta["path"] = resume
            check_compatible(meta, job)
            resume_run_dir = meta.get("run_dir")
            hf_source = meta.get("hf_source_config")
    init = init_megatron = None
    check_trace_dir(job, layout, world_size=world_size, resuming=resume is not None)
    if job.checkpoint.init_from_hf and resume is None:
        init = check_init_source(job.checkpoint.init_from_hf, job.model)
        hf_source = read_hf_source_config(init)
    if job.checkpoint.init_from_megatron and resume is None:
        init_megatron = check_init_megatron(job.checkpoint.init_from_megatron, job.model)
    dp_rank = dp_rank_of(layout, rank)
    data = build_data(
        job.data,
        seq_length=job.train.seq_length,
        global_batch_size=job.train.global_batch_size,
        micro_batch_size=job.train.micro_batch_size,
        dp_rank=dp_rank,
        dp_size=layout.dp,
        model_vocab_size=job.model.vocab_size,
    )
    return Prepared(
        layout=layout,
        data=data,
        dp_rank=dp_rank,
        resume=resume,
        resume_run_dir=resume_run_dir,
        expert_backend=expert_backend,
        init_from_hf=init,
        hf_source_config=hf_source,
        init_from_megatron=init_megatron,
    )


@dataclasses.dataclass
class _Run:
    """What the phases of one training run share: the job, the model and optimizer, where the numbers
    go, and the loop's progress."""

    job: JobConfig
    prep: Prepared
    ps: Any
    """The parallel state (process groups of the layout)."""
    own_ps: bool
    """True when :func:`train` built ``ps`` (and destroys it at the end)."""
    device: torch.device
    rank: int
    num_microbatches: int
    """This DP rank's micro-batches per step: ``global_batch / (micro_batch · DP)``."""
    chunks: List[nn.Module]
    optimizer: FoldedOptimizer
    resumed_from: Optional[str]
    init_from_hf: Optional[str]
    """The weights the run started from (``checkpoint.init_from_hf`` or ``init_from_megatron``), or ``None``."""
    stats: MoEStats
    sink: Optional[MetricsSink]
    """Rank 0's metrics sink; ``None`` elsewhere."""
    collapse: Optional[CollapseWatch]
    """Rank 0's router-collapse watch; ``None`` elsewhere."""
    throughput: Throughput
    run_dir: str
    run_log: Any
    timer: StepTimer
    stop: StopRequest = dataclasses.field(default_factory=StopRequest)
    stopped: bool = False
    """True once a stop request reached every rank (through a step's all-reduce)."""
    saved_at: Optional[int] = None
    """Step of the last checkpoint saved or loaded by this run."""
    saver: Optional[AsyncSaver] = None
    """The asynchronous saves (``checkpoint.async_save`` with ``checkpoint.dir``), or ``None``."""
    save_written: bool = False
    """True after a step's all-reduce showed that no rank is still writing the pending save."""
    history: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    tracer: Optional[RoutingTracer] = None
    """The routing trace (``moe.trace_dir``), or ``None``."""
    replicas: Optional[ReplicaSchedule] = None
    """The re-plans of the hot-expert replica slots (``moe.expert_replicas``), or ``None``."""
    overlap: OverlapRuntime = dataclasses.field(default_factory=OverlapRuntime)
    """The overlap runtime every step's schedule runs under (``parallel.overlap_moe_comm``: one helper
    thread for the run; its counters give each step's ``overlap_pairs`` and ``overlap_hand_overs``)."""


@dataclasses.dataclass
class _StepLosses:
    """The step's losses over the global batch, read off the world all-reduce."""

    loss: float
    """The objective: LM loss + MTP loss × its scaling factor + every router loss."""
    lm_loss: float
    mtp_loss: float
    moe: Dict[str, Any]
    """:meth:`MoEStats.summarize` of the step (router losses, expert counts, dropped fraction)."""


def train(
    job: JobConfig,
    *,
    run_dir: str,
    prepared: Optional[Prepared] = None,
    parallel_state=None,
    run_log=None,
    stop: Optional[StopRequest] = None,
) -> Dict[str, Any]:
    """Run ``job`` to ``train.steps`` on the initialized world; return a summary (every rank):
    ``history`` (per-step loss, lm_loss, grad_norm, lr, skipped, and this rank's ``overlap_pairs`` and
    ``overlap_hand_overs``: merged forward-backward pairs run and lane switches), ``metrics_file``, ``chunks``
    (this rank's trained model chunks) and ``optimizer`` (its :class:`~folding.optim.FoldedOptimizer`).

    ``prepared`` defaults to :func:`prepare` on this world; ``parallel_state`` to the layout's groups
    (built here and destroyed at the end). Only rank 0 writes (metrics under ``run_dir``); its
    console lines also go to ``run_log`` (a :class:`~folding.launch.run_dir.RunLog`) when given.
    ``stop``: a :class:`~folding.training.faults.StopRequest` the caller installed before (a signal
    that came while the run was being set up then stops it after its first step); default: a request
    installed for the loop only.
    """
    prep = prepared or prepare(job, world_size=dist.get_world_size(), rank=dist.get_rank())
    own_ps = parallel_state is None
    ps = parallel_state or build_parallel_state(
        # with overlap, every role both lanes use on a communicator of its own (NCCL runs one in issue order)
        prep.layout,
        timeout_s=job.train.collective_timeout_s,
        own_communicators=job.parallel.overlap_moe_comm,
    )
    run = _start(job, prep, ps, own_ps=own_ps, run_dir=run_dir, run_log=run_log)
    run.stop = stop or run.stop
    try:
        with run.stop.installed():
            _log_run(run)
            for step in range(run.optimizer.step_count + 1, job.train.steps + 1):
                _train_step(run, step)
                if run.stopped:
                    report_stop(run, step)
                    break
            if run.saver:  # normal end: nothing may stay unpublished
                if run.saver.pending is not None:
                    published(run, run.saver.finish(), blocked_s=None)
                run.saver.close()
    finally:
        run.overlap.close()
        run.stats.close()
        if run.tracer:
            run.tracer.close()
        if run.sink:
            run.sink.close()
        if run.own_ps:
            run.ps.destroy()  # collective, except while an exception propagates (peers may never come)
    return {
        "history": run.history,
        "metrics_file": run.sink.path if run.sink else None,
        "chunks": run.chunks,
        "optimizer": run.optimizer,
        "resumed_from": run.resumed_from,
        "stopped": run.stopped,
        "last_checkpoint_step": run.saved_at,
    }


# ----------------------------------------------------------------------------- setting up a run
def _start(job: JobConfig, prep: Prepared, ps, *, own_ps: bool, run_dir: str, run_log) -> _Run:
    """Build the model chunks and the optimizer, load the checkpoint to resume from, find the routers
    and open rank 0's metrics sink."""
    device, t = training_device(), job.train
    M = t.global_batch_size // (t.micro_batch_size * prep.layout.dp)
    resumed_from, init_from, init_megatron = _starting_point(job, prep)
    chunks = _build_chunks(
        job,
        ps,
        device,
        expert_backend=prep.expert_backend or None,
        aux_loss_scale=1.0 / (M * prep.layout.dp),
        init_from=init_from or init_megatron,
        init_loader=load_megatron_weights if init_megatron else load_initial_weights,
    )
    optimizer = FoldedOptimizer(torch.nn.ModuleList(chunks), job.optim, parallel_state=ps, train_steps=t.steps)
    if resumed_from:
        load_checkpoint(resumed_from, chunks=chunks, optimizer=optimizer, data=prep.data, job=job)
    stats = MoEStats(chunks, model_config=job.model)
    replica_layers = [m for c in chunks for m in c.modules() if isinstance(m, MoELayer) and m.num_replicas]
    rank, world = dist.get_rank(), dist.get_world_size()
    return _Run(
        job=job,
        prep=prep,
        ps=ps,
        own_ps=own_ps,
        device=device,
        rank=rank,
        num_microbatches=M,
        chunks=chunks,
        optimizer=optimizer,
        resumed_from=resumed_from,
        init_from_hf=init_from or init_megatron,
        stats=stats,
        sink=_open_sink(job, run_dir, run_log, optimizer.step_count if resumed_from else None) if rank == 0 else None,
        collapse=CollapseWatch(moe_layers=stats.moe_layers, topk=job.moe.topk) if rank == 0 else None,
        throughput=Throughput(job, device=device, world_size=world),
        run_dir=run_dir,
        run_log=run_log,
        timer=StepTimer(device),
        saved_at=optimizer.step_count if resumed_from else None,
        replicas=ReplicaSchedule(replica_layers, interval=job.moe.replica_interval) if replica_layers else None,
        saver=AsyncSaver(timeout_s=t.collective_timeout_s)
        if job.checkpoint.async_save and job.checkpoint.dir
        else None,
        tracer=RoutingTracer.start(job, prep.layout, rank=rank, world_size=world, start_step=optimizer.step_count + 1),
    )


def _build_chunks(
    job: JobConfig,
    ps,
    device: torch.device,
    *,
    expert_backend: Optional[str],
    aux_loss_scale: float = 1.0,
    init_from: Optional[str] = None,
    init_loader=load_initial_weights,
) -> List[nn.Module]:
    """This rank's model chunks in training mode (compiled with ``train.compile``): initialized from
    ``train.seed``, or, with ``init_from``, built on ``meta`` and filled with this rank's slices of
    those weights by ``init_loader(chunks, init_from)`` (:func:`folding.checkpoint.from_hf.load_initial_weights`,
    or :func:`folding.checkpoint.from_megatron.load_megatron_weights`). ``expert_backend``: the backend
    :func:`prepare` resolved for this machine (``None``: resolved at the build); ``aux_loss_scale``: the
    routers' loss weight, 1 / (micro-batches · DP)."""
    t = job.train
    settings = LayerSettings(
        init_seed=t.seed,
        params_dtype=compute_dtype(job),
        device="meta" if init_from else device,
        recompute=t.recompute_setting(),
        offload_modules=t.offload_setting(),
        overlap_comm=job.parallel.overlap_moe_comm,
        delay_wgrad=job.parallel.delay_wgrad,
        expert_backend=expert_backend,
        aux_loss_scale=aux_loss_scale,
        compile_dense=t.compile,
    )
    chunks = build_stage_chunks(model_config=job.model, parallel_state=ps, settings=settings)
    if init_from:
        for c in chunks:
            materialize(c, device=device, init_seed=None)
        init_loader(chunks, init_from)
    for c in chunks:
        c.train()
    return chunks


def _open_sink(job: JobConfig, run_dir: str, run_log, resumed_at: Optional[int] = None) -> MetricsSink:
    """Rank 0's metrics sink under ``run_dir`` (console lines also to ``run_log`` when given); a run resumed
    after step ``resumed_at`` replaces the records of the steps it replays."""
    return MetricsSink(
        job.logging,
        run_dir=run_dir,
        total_steps=job.train.steps,
        run_config=job.to_dict(),
        echo=run_log.echo if run_log else None,
        resumed_at=resumed_at,
    )


def _starting_point(job: JobConfig, prep: Prepared) -> Tuple[Optional[str], Optional[str], Optional[str]]:
    """``(checkpoint to resume, Hugging Face weights to initialize from, Megatron checkpoint to initialize
    from)`` as :func:`prepare` chose them on rank 0 (broadcast, so that every rank agrees; at most one is
    set). Collective over the world when ``checkpoint.dir``, ``load``, ``init_from_hf`` or
    ``init_from_megatron`` is set."""
    ck = job.checkpoint
    if not (ck.dir or ck.load or ck.init_from_hf or ck.init_from_megatron):
        return None, None, None
    box = [(prep.resume, prep.init_from_hf, prep.init_from_megatron)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _log_run(run: _Run) -> None:
    """Rank 0 writes the ``run`` record: layout, world, model size, where the loop starts."""
    if run.sink:
        run.sink.log(
            {
                "kind": "run",
                "layout": run.prep.layout.describe(),
                "world_size": dist.get_world_size(),
                "parameters": run.job.model.num_parameters()[0],
                "microbatches_per_step": run.num_microbatches,
                "resumed_from": run.resumed_from,
                "init_from_hf": run.init_from_hf,
                "start_step": run.optimizer.step_count + 1,
            }
        )


# ------------------------------------------------------------------------------- one step
def _train_step(run: _Run, step: int) -> None:
    """One optimizer step, in phases: data, forward/backward, the world reduction, clip and step,
    router updates, metrics, evaluation and checkpoint when due."""
    run.timer.restart()
    mbs, n_tokens = _read_batch(run)
    baton = run.overlap.stats
    pairs0, hand_overs0 = baton.pairs, baton.hand_overs
    out = _forward_backward(run, mbs, n_tokens)
    paired = {"overlap_pairs": baton.pairs - pairs0, "overlap_hand_overs": baton.hand_overs - hand_overs0}
    losses = _reduce(run, out, n_tokens)
    replicas, replans = None, []
    if run.replicas:  # the step's world-summed loads, the same on every rank: no collective of its own
        counts = losses.moe["counts_LE"]
        loads = {layer: counts[row] for layer, row in run.stats.row_of.items()}
        replicas = run.replicas.summary(loads)  # the tables this step ran with
        replans = run.replicas.observe(loads)
    if run.tracer:
        run.tracer.write(step)
    lr = run.optimizer.lr
    grad_norm, skipped = _clip_and_step(run.optimizer, losses.loss)
    _update_routers(run, skipped=skipped)
    record = _train_record(run, step, losses, grad_norm=grad_norm, lr=lr, skipped=skipped, n_tokens=n_tokens)
    if run.job.parallel.overlap_moe_comm:  # this rank's merged forward-backward pairs: overlap is in effect
        record.update(paired)
    if replicas is not None:
        record["replicas"] = replicas
    run.history.append({k: record[k] for k in ("step", "loss", "lm_loss", "grad_norm", "lr", "skipped")} | paired)
    if run.sink:
        run.sink.log(record)
        for warning in run.collapse.update(step, losses.moe["counts_LE"]):
            run.sink.warn(step, warning.pop("message"), **warning)
        for rec in replans:
            run.sink.event("replan", step, replan_message(step, rec), **rec)
    evaluate_if_due(run, step)
    checkpoint_if_due(run, step)


def _read_batch(run: _Run) -> Tuple[List[Dict[str, torch.Tensor]], torch.Tensor]:
    """This DP rank's micro-batches of the step and the global count N of unmasked tokens (an
    all-reduce over DP, known before any backward)."""
    mbs = [next(run.prep.data.train) for _ in range(run.num_microbatches)]
    return mbs, global_token_count(mbs, dp_group=run.ps.groups.dp, device=run.device)


def _forward_backward(run: _Run, mbs, n_tokens: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Zero the gradients and the router statistics, run the pipeline schedule over ``mbs`` with
    loss ``masked_sum / N`` (gradients then *sum* over DP×CP and EDP in the optimizer), then collect
    the routing statistics the MoE layers kept."""
    run.optimizer.zero_grad()
    run.stats.reset()
    out = run_microbatches(
        run.chunks,
        mbs,
        parallel_state=run.ps,
        loss_scale=1.0 / float(n_tokens.clamp(min=1)),
        no_sync=run.optimizer.no_sync,
        overlap=run.job.parallel.overlap_moe_comm,
        runtime=run.overlap,
    )
    run.stats.collect()
    return out


def _reduce(run: _Run, out: Dict[str, torch.Tensor], n_tokens: torch.Tensor) -> _StepLosses:
    """One world all-reduce of [LM loss sum, MTP loss sum, router statistics, stop flag, writing flag]:
    the step's losses, :attr:`_Run.stopped` when any rank saw a stop request, and
    :attr:`_Run.save_written` when no rank is still writing the pending asynchronous save."""
    job, ps, layout, device = run.job, run.ps, run.prep.layout, run.device
    parts = torch.stack([out["lm_loss_sum"], out["mtp_loss_sum"]]).to(device=device, dtype=torch.float64)
    # per-token losses are identical on the TP ranks of the last stage: count them once
    parts = parts / layout.tp if ps.is_last_stage else torch.zeros_like(parts)
    writing = run.saver is not None and run.saver.writing()
    flags = torch.tensor([1.0 if run.stop.requested else 0.0, float(writing)], dtype=torch.float64, device=device)
    vec = torch.cat([parts, run.stats.vector().to(device), flags])
    if run.tracer:  # the routing trace's gather on rank 0, covered by the host read below
        run.tracer.gather(run.stats)
    dist.all_reduce(vec)
    stop, still_writing = vec[-2:].tolist()  # one host read for both flags
    vec, run.stopped = vec[:-2], stop > 0
    run.save_written = run.saver is not None and run.saver.pending is not None and still_writing == 0
    lm_loss, mtp_loss = (vec[:2] / n_tokens.clamp(min=1)).tolist()  # one host read for both
    moe = run.stats.summarize(
        vec[2:], num_microbatches=run.num_microbatches * layout.dp, dp=layout.dp, topk=job.moe.topk
    )
    loss = lm_loss + job.model.mtp_loss_scaling_factor * mtp_loss + sum(moe[n] for n in LOSS_NAMES)
    return _StepLosses(loss=loss, lm_loss=lm_loss, mtp_loss=mtp_loss, moe=moe)


def _clip_and_step(optimizer: FoldedOptimizer, loss: float) -> Tuple[float, bool]:
    """Clip and step; ``(grad_norm, skipped)``. A NaN/Inf loss or gradient norm skips the update (the
    LR schedule still advances)."""
    if math.isfinite(loss):
        grad_norm, skipped = optimizer.clip_and_step()
    else:
        grad_norm, skipped = optimizer.grad_norm(), True
    if skipped:
        _skip_update(optimizer)
    return grad_norm, skipped


def _skip_update(optimizer) -> None:
    """Advance the LR schedule without changing parameters, optimizer moments or the count of AdamW
    updates (its bias correction)."""
    optimizer.step_count += 1


def _update_routers(run: _Run, *, skipped: bool) -> None:
    """Once per global batch: move the expert biases (one all-reduce for every layer; not after a
    skipped update) and restart the ``global_aux_loss`` token counts."""
    routers = run.stats.routers
    biased = [r for r in routers if r.has_expert_bias]
    if biased and not skipped:
        update_expert_biases(biased, group=run.ps.groups.tp_dp_cp)
    for r in routers:
        if r.accumulates_global_aux_loss:
            r.reset_global_aux_loss()


def _train_record(
    run: _Run, step: int, losses: _StepLosses, *, grad_norm: float, lr: float, skipped: bool, n_tokens: torch.Tensor
) -> Dict[str, Any]:
    """The step's ``train`` record: losses, update, speed and memory (a world all-reduce), expert load."""
    speed = run.throughput.measure(run.timer.elapsed())
    moe = losses.moe
    return {
        "kind": "train",
        "step": step,
        "loss": losses.loss,
        "lm_loss": losses.lm_loss,
        **({"mtp_loss": losses.mtp_loss} if run.job.model.mtp_num_layers else {}),
        **{n: moe[n] for n in LOSS_NAMES},
        "grad_norm": grad_norm,
        "lr": lr,
        "skipped": skipped,
        "tokens": int(n_tokens),
        **speed,
        **expert_load_summary(moe["counts_LE"]),
        "dropped_fraction": moe["dropped_fraction"],
        "expert_counts": moe["counts_LE"],
    }
