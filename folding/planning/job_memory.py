"""The memory model read with a job's settings: per-rank bytes of every pipeline stage, and the precision
it assumes.

The one memory model (:func:`folding.planning.memory.memory_per_rank`) takes plain arguments; this module
reads them from a training job (a :class:`folding.job.config.JobConfig`, or any object with its
``model``, ``parallel``, ``train`` and ``optim`` sections), so that the dry run, its memory check and
:func:`folding.planning.suggestions.memory_suggestions` ask the same question: ``train.precision`` sets
the parameter and activation width (bf16: 2 bytes, fp32: 4), ``optim.*`` the optimizer's dtypes and
sharding, ``train.recompute``, ``train.seq_length``, ``train.micro_batch_size`` and the micro-batches per
step (``train.global_batch_size`` over micro-batch × DP), ``parallel.overlap_moe_comm`` the longer
warm-up's activations in flight. The experts' activations are counted as the engine keeps them (3
``F``-wide tensors per routed row).

Usage::

    est = job_memory(job, layout)                 # the stage with the largest total
    every = stage_memories(job, layout)           # one estimate per pipeline stage
    precision_summary(param_bytes=2, act_bytes=2, optim_precision=OptimizerPrecision())
"""

from __future__ import annotations

from typing import List, Optional

from .memory import MemoryEstimate, memory_per_rank
from .moe_overlap import memory_with_overlap
from .optim_precision import OptimizerPrecision

WIDTHS = {"bf16": 2, "fp32": 4}
"""Bytes per parameter and activation element of each ``train.precision``."""
DTYPES = {2: "bf16", 4: "fp32"}
"""The dtype name of an element width."""


def job_width(job) -> int:
    """Bytes per parameter and activation element under the job's ``train.precision``."""
    return WIDTHS[job.train.precision]


def job_memory(job, layout, *, stage: Optional[int] = None) -> MemoryEstimate:
    """Bytes per rank of pipeline ``stage`` (``None``: the stage with the largest total) for ``job`` on
    ``layout`` (its validated :class:`~folding.parallel.ParallelLayout`), from
    :func:`~folding.planning.memory.memory_per_rank` with the job's settings (see the module docstring)."""
    t = job.train
    width = job_width(job)
    estimate = memory_with_overlap if job.parallel.overlap_moe_comm else memory_per_rank
    return estimate(
        job.model,
        layout,
        stage=stage,
        param_bytes=width,
        distributed=job.optim.distributed,
        recompute=t.recompute_setting(),
        seq_length=t.seq_length,
        micro_batch_size=t.micro_batch_size,
        act_bytes=width,
        num_microbatches=t.global_batch_size // (t.micro_batch_size * layout.dp),
        optim_precision=OptimizerPrecision.of(job.optim),
        offload=t.offload_setting(),
    )


def stage_memories(job, layout) -> List[MemoryEstimate]:
    """:func:`job_memory` of every pipeline stage, in stage order."""
    return [job_memory(job, layout, stage=k) for k in range(layout.pp)]


def precision_summary(*, param_bytes: int, act_bytes: int, optim_precision: OptimizerPrecision) -> str:
    """The precision the memory model assumes, in words: ``parameters bf16 (routers fp32), activations bf16,
    main grads fp32, master weights fp32 copy, AdamW exp_avg fp32, exp_avg_sq fp32``. Parameters of 4 bytes are
    their own master weights; under ``optim.name=muon`` the hidden matrices keep one fp32 momentum and the
    rest AdamW's moments."""
    prec = optim_precision
    master = "fp32 copy" if prec.master_bytes(param_bytes) else f"{DTYPES[param_bytes]} (the parameters themselves)"
    moments = f"exp_avg {prec.exp_avg_dtype}, exp_avg_sq {prec.exp_avg_sq_dtype}"
    optimizer = (
        f"Muon momentum fp32 for the hidden matrices, AdamW {moments} for the rest"
        if prec.name == "muon"
        else f"AdamW {moments}"
    )
    routers = " (routers fp32)" if param_bytes != 4 else ""
    return (
        f"parameters {DTYPES[param_bytes]}{routers}, activations {DTYPES[act_bytes]}, main grads "
        f"{prec.main_grads_dtype}, master weights {master}, {optimizer}"
    )


def job_precision(job) -> str:
    """:func:`precision_summary` of ``job`` (``train.precision`` and ``optim.*``)."""
    width = job_width(job)
    return precision_summary(param_bytes=width, act_bytes=width, optim_precision=OptimizerPrecision.of(job.optim))
