"""The training loop: one optimizer step per global batch, metrics, evaluation, NaN/Inf skipping.

:func:`prepare` does everything that can fail on bad input (config checks, the layout, opening the
data) without any process group; :func:`train` runs the loop on an initialized ``torch.distributed``
world (:mod:`folding.training.launch` creates it; tests call :func:`train` inside their rank pool).

One step (1-based: step k is reported after the k-th optimizer update):

1. read this DP rank's ``M = global_batch / (micro_batch · DP)`` micro-batches;
2. all-reduce their loss-mask sums over DP: the global count N of unmasked tokens, known before any
   backward;
3. forward/backward each micro-batch with loss ``masked_sum / N`` (gradients then *sum* over DP×CP
   and EDP in the optimizer);
4. one world all-reduce of [LM loss sum, expert counts, dropped pairs, router losses];
5. if the loss or the gradient norm is NaN/Inf the update is skipped (logged ``skipped: true``), the
   data and the LR schedule still advance; otherwise clip and step;
6. rank 0 writes the ``train`` record; every ``train.eval_interval`` steps an ``eval`` record;
7. with ``checkpoint.dir`` set, a checkpoint every ``checkpoint.save_interval`` steps, at the last
   step, and after a SIGTERM/SIGINT (seen by every rank through the step's all-reduce), after which
   the loop stops.

A run with a checkpoint to resume from (:func:`prepare` picks it: ``checkpoint.load``, or the
latest complete one in ``checkpoint.dir``) loads it after building the model and continues from
its step to ``train.steps``, in whatever layout this run has.

Usage::

    prep = prepare(job, world_size=dist.get_world_size(), rank=dist.get_rank())
    summary = train(job, run_dir=run_dir, prepared=prep)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import resource
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ..data.build import build_data
from ..model.chunks import build_stage_chunks
from ..model.compile import compile_dense
from ..optim.expert_bias import update_expert_biases
from ..optim.optimizer import FoldedOptimizer
from ..parallel import ParallelLayout, build_parallel_state
from ..pipeline.stage import run_microbatches
from ..planning.flops import flops_per_token
from ..planning.hardware import get_gpu
from .checkpoint import check_compatible, load_checkpoint, read_meta, resolve_resume, save_checkpoint
from .config import ConfigError, JobConfig
from .evaluate import evaluate, global_token_count
from .faults import StopRequest
from .metrics import MetricsSink, StepTimer, expert_load_summary
from .moe_stats import LOSS_NAMES, MoEStats
from .validate import validate_job


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


def dp_rank_of(layout: ParallelLayout, rank: int) -> int:
    """Attention DP rank of global ``rank`` under ``layout`` (pure rank math, no process group)."""
    for group in layout.groups()["attention"]["dp"]:
        if rank in group:
            return group.index(rank)
    raise ValueError(f"rank {rank} is outside the layout's world of {layout.world_size}")


def prepare(job: JobConfig, *, world_size: int, rank: int) -> Prepared:
    """Validate ``job`` for ``world_size`` ranks and open this rank's data; no collective, no writes
    except the data cache. Raises :class:`ConfigError` (or the data module's ``ValueError``)."""
    layout = validate_job(job, world_size=world_size)
    resume = resume_run_dir = None
    if job.checkpoint.dir or job.checkpoint.load:
        resume = resolve_resume(job.checkpoint)
        if resume is not None:
            meta = read_meta(resume)
            meta["path"] = resume
            check_compatible(meta, job)
            resume_run_dir = meta.get("run_dir")
    dp_rank = dp_rank_of(layout, rank)
    data = build_data(
        job.data,
        seq_length=job.train.seq_length,
        global_batch_size=job.train.global_batch_size,
        micro_batch_size=job.train.micro_batch_size,
        dp_rank=dp_rank,
        dp_size=layout.dp,
    )
    if data.vocab_size > job.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={job.model.vocab_size} is smaller than the vocabulary of "
            f"data.tokenizer={job.data.tokenizer!r} ({data.vocab_size}); raise model.vocab_size "
            "or use the model's tokenizer"
        )
    return Prepared(layout=layout, data=data, dp_rank=dp_rank, resume=resume, resume_run_dir=resume_run_dir)


def training_device() -> torch.device:
    """``cuda:<LOCAL_RANK>`` when CUDA is available, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _flops_per_token(job: JobConfig) -> float:
    return flops_per_token(job.model, job.train.seq_length).model_training


def _peak_tflops(job: JobConfig, device: torch.device) -> Optional[float]:
    if job.logging.peak_tflops:
        return float(job.logging.peak_tflops)
    if device.type != "cuda":
        return None
    try:
        name = torch.cuda.get_device_name(device).lower()
        for kind in ("h200", "h100", "b200", "a100"):
            if kind in name:
                return get_gpu(kind).peak_flops("bf16") / 1e12
    except ValueError:
        return None
    return None


def _skip_update(optimizer) -> None:
    """Advance the LR schedule without changing parameters, optimizer moments or the count of AdamW
    updates (its bias correction)."""
    optimizer.step_count += 1


def train(
    job: JobConfig, *, run_dir: str, prepared: Optional[Prepared] = None, parallel_state=None, run_log=None
) -> Dict[str, Any]:
    """Run ``job`` to ``train.steps`` on the initialized world; return a summary (every rank):
    ``history`` (per-step loss, lm_loss, grad_norm, lr, skipped), ``metrics_file`` and ``chunks``
    (this rank's trained model chunks).

    ``prepared`` defaults to :func:`prepare` on this world; ``parallel_state`` to the layout's groups
    (built here and destroyed at the end). Only rank 0 writes (metrics under ``run_dir``); its
    console lines also go to ``run_log`` (a :class:`~folding.training.run_dir.RunLog`) when given.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    prep = prepared or prepare(job, world_size=world, rank=rank)
    own_ps = parallel_state is None
    ps = parallel_state or build_parallel_state(prep.layout, timeout_s=job.train.collective_timeout_s)
    device = training_device()
    t = job.train
    dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
    layout = prep.layout
    M = t.global_batch_size // (t.micro_batch_size * layout.dp)
    chunks = build_stage_chunks(
        model_config=job.model,
        parallel_state=ps,
        recompute=t.recompute,
        overlap_moe_comm=job.parallel.overlap_moe_comm,
        params_dtype=dtype,
        init_seed=t.seed,
        device=device,
    )
    for c in chunks:
        c.train()
    if t.compile:
        compile_dense(chunks)
    model = torch.nn.ModuleList(chunks)
    optimizer = FoldedOptimizer(model, job.optim, parallel_state=ps, train_steps=t.steps)
    resumed_from = _resume(job, prep, chunks=chunks, optimizer=optimizer)
    stats = MoEStats(chunks, model_config=job.model)
    stats.set_aux_loss_scale(1.0 / (M * layout.dp))
    sink = (
        MetricsSink(
            job.logging,
            run_dir=run_dir,
            total_steps=t.steps,
            run_config=job.to_dict(),
            echo=run_log.echo if run_log else None,
        )
        if rank == 0
        else None
    )
    flops_tok, peak = _flops_per_token(job), _peak_tflops(job, device)
    timer = StepTimer(device)
    data = prep.data
    history: List[Dict[str, Any]] = []
    stop = StopRequest()
    stopped = False
    saved_at = optimizer.step_count if resumed_from else None
    exits = contextlib.ExitStack()
    try:
        exits.enter_context(stop.installed())
        if sink:
            sink.log(
                {
                    "kind": "run",
                    "layout": layout.describe(),
                    "world_size": world,
                    "parameters": job.model.num_parameters()[0],
                    "microbatches_per_step": M,
                    "resumed_from": resumed_from,
                    "start_step": optimizer.step_count + 1,
                }
            )
        for step in range(optimizer.step_count + 1, t.steps + 1):
            timer.restart()
            mbs = [next(data.train) for _ in range(M)]
            n_tokens = global_token_count(mbs, dp_group=ps.dp_group, device=device)
            optimizer.zero_grad()
            stats.reset()
            out = run_microbatches(
                chunks,
                mbs,
                parallel_state=ps,
                loss_scale=1.0 / float(n_tokens.clamp(min=1)),
                no_sync=optimizer.no_sync,
                overlap=job.parallel.overlap_moe_comm,
            )
            parts = torch.stack([out["lm_loss_sum"], out["mtp_loss_sum"]]).to(device=device, dtype=torch.float64)
            # per-token losses are identical on the TP ranks of the last stage: count them once
            parts = parts / layout.tp if ps.is_last_stage else torch.zeros_like(parts)
            flag = torch.tensor([1.0 if stop.requested else 0.0], dtype=torch.float64, device=device)
            vec = torch.cat([parts, stats.vector().to(device), flag])
            dist.all_reduce(vec)
            stopped, vec = bool(vec[-1] > 0), vec[:-1]
            lm_loss, mtp_loss = (vec[:2] / n_tokens.clamp(min=1)).tolist()  # one host read for both
            moe = stats.summarize(vec[2:], num_microbatches=M * layout.dp, dp=layout.dp, topk=job.moe.topk)
            loss = lm_loss + job.model.mtp_loss_scaling_factor * mtp_loss + sum(moe[n] for n in LOSS_NAMES)
            lr = optimizer.lr
            if math.isfinite(loss):
                grad_norm, skipped = optimizer.clip_and_step()
            else:
                grad_norm, skipped = optimizer.grad_norm(), True
            if skipped:
                _skip_update(optimizer)
            biased = [r for r in stats.routers if getattr(r, "expert_bias", None) is not None]
            if biased and not skipped:  # one all-reduce for every layer's expert bias
                update_expert_biases(biased, group=ps.tp_dp_cp_group)
            for r in stats.routers:
                if getattr(getattr(r, "config", None), "aux_loss_type", None) == "global_aux_loss":
                    r.reset_global_aux_loss()
            seconds = timer.elapsed()
            mem = torch.tensor([_memory_gib(device)], dtype=torch.float64, device=device)
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            tokens_per_s = t.global_batch_size * t.seq_length / seconds
            tflops = flops_tok * tokens_per_s / world / 1e12
            record = {
                "kind": "train",
                "step": step,
                "loss": loss,
                "lm_loss": lm_loss,
                **({"mtp_loss": mtp_loss} if job.model.mtp_num_layers else {}),
                **{n: moe[n] for n in LOSS_NAMES},
                "grad_norm": grad_norm,
                "lr": lr,
                "skipped": skipped,
                "tokens": int(n_tokens),
                "step_time_s": seconds,
                "tokens_per_s": tokens_per_s,
                "tflops_per_device": tflops,
                "mfu": tflops / peak if peak else None,
                "mem_gib": float(mem),
                **expert_load_summary(moe["counts_LE"]),
                "dropped_fraction": moe["dropped_fraction"],
                "expert_counts": moe["counts_LE"],
            }
            history.append({k: record[k] for k in ("step", "loss", "lm_loss", "grad_norm", "lr", "skipped")})
            if sink:
                sink.log(record)
            if t.eval_interval and data.valid is not None and (step % t.eval_interval == 0 or step == t.steps):
                ev = evaluate(
                    chunks, data.valid, parallel_state=ps, num_microbatches=M, eval_steps=t.eval_steps, device=device
                )
                history[-1]["eval_lm_loss"] = ev["lm_loss"]
                if sink:
                    sink.log({"kind": "eval", "step": step, **ev})
            ck = job.checkpoint
            if ck.dir and (stopped or step == t.steps or (ck.save_interval and step % ck.save_interval == 0)):
                path = save_checkpoint(
                    ck.dir,
                    step=step,
                    chunks=chunks,
                    optimizer=optimizer,
                    data=data,
                    job=job,
                    layout=layout,
                    run_dir=run_dir,
                )
                saved_at = step
                if sink:
                    sink.log({"kind": "checkpoint", "step": step, "path": path})
            if stopped:
                if rank == 0:
                    line = f"stop requested by a signal: stopped after step {step}" + (
                        ", checkpoint saved" if saved_at == step else ", no checkpoint (checkpoint.dir is unset)"
                    )
                    (run_log.echo if run_log else print)(line)
                break
    finally:
        exits.close()
        stats.close()
        if sink:
            sink.close()
        if own_ps:
            ps.destroy()  # collective, except while an exception propagates (peers may never come)
    return {
        "history": history,
        "metrics_file": sink.path if sink else None,
        "chunks": chunks,
        "resumed_from": resumed_from,
        "stopped": stopped,
        "last_checkpoint_step": saved_at,
    }


def _resume(job: JobConfig, prep: Prepared, *, chunks, optimizer) -> Optional[str]:
    """Load the checkpoint :func:`prepare` chose (rank 0's choice, broadcast so that every rank
    agrees); return its path or ``None``. Collective over the world."""
    if not (job.checkpoint.dir or job.checkpoint.load):
        return None
    box = [prep.resume]
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return None
    load_checkpoint(box[0], chunks=chunks, optimizer=optimizer, data=prep.data, job=job)
    return box[0]
