"""The device memory a job must fit: ``parallel.gpu``, else this machine's CUDA device; the dry run's check.

``parallel.gpu`` names a kind of the planner's table (:mod:`folding.planning.hardware`: h100 80 GB, h200
141 GB, b200 180 GB). Left null, the job is checked against this machine's first CUDA device, taken for a
kind of the table when its name and memory match one (:func:`folding.planning.hardware.device_gpu`), and
against nothing on a machine without CUDA. A stage fits when its predicted peak per rank, plus the
allocator's overhead, is within what PyTorch can use of the GPU (:meth:`GPUSpec.fits`, the planner's own
test, so that a plan the planner lists passes its dry run). A job with a stage that does not fit is refused
with a :class:`~folding.job.config.ConfigError` naming every such stage, its peak and the GPU's memory,
and the changes that would lower the largest one (:func:`folding.planning.suggestions.memory_suggestions`).

Usage::

    gpu, source = job_gpu(job)                 # (None, why) when there is nothing to check against
    check_memory_fits(job, layout, gpu, source, stage_memories(job, layout))   # raises ConfigError
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from ..job.config import ConfigError, JobConfig
from ..job.machine import cuda_device_here
from ..planning.hardware import GIB, GPUSpec, device_gpu, get_gpu, list_gpus
from ..planning.memory import MemoryEstimate
from ..planning.suggestions import memory_suggestions


def named_gpu(job: JobConfig) -> Optional[GPUSpec]:
    """The table's kind that ``parallel.gpu`` names (``None`` when null); an unknown name raises
    :class:`ConfigError` listing the kinds."""
    name = job.parallel.gpu
    if name is None:
        return None
    try:
        return get_gpu(str(name))
    except ValueError:
        raise ConfigError(
            f"parallel.gpu={name!r}: unknown GPU kind; choose one of {', '.join(list_gpus())}, or null "
            "(this machine's CUDA device)"
        ) from None


def job_gpu(job: JobConfig) -> Tuple[Optional[GPUSpec], str]:
    """The GPU ``job``'s memory is checked against and how it was chosen: ``parallel.gpu``'s kind, else
    this machine's CUDA device (:func:`folding.job.machine.cuda_device_here`), else ``None`` (no check)."""
    gpu = named_gpu(job)
    if gpu is not None:
        return gpu, f"parallel.gpu={job.parallel.gpu}"
    here = cuda_device_here()
    if here is None:
        return None, "parallel.gpu=null and no CUDA device on this machine"
    name, total = here
    gpu = device_gpu(name, total)
    kind = f", the {gpu.name} of the table" if gpu.name != name else ""
    return gpu, f"parallel.gpu=null: this machine's {name}{kind}"


def _capacity(gpu: GPUSpec) -> str:
    return f"{gpu.name}'s {gpu.memory_gb:.0f} GB leave {gpu.usable_memory_gib:.1f} GiB to PyTorch's allocator"


def check_memory_fits(
    job: JobConfig, layout, gpu: Optional[GPUSpec], source: str, stages: List[MemoryEstimate]
) -> None:
    """Raise :class:`ConfigError` when a pipeline stage's estimate in ``stages`` (one per stage) does not
    fit ``gpu`` (nothing to check when ``gpu`` is ``None``): the message names each stage that does not
    fit with its peak per rank, the GPU's memory, and the changes that lower the largest stage's peak."""
    if gpu is None:
        return
    over = [e for e in stages if not gpu.fits(e.total)]
    if not over:
        return
    worst = max(over, key=lambda e: e.total)
    peaks = ", ".join(f"stage {e.stage} {e.total / GIB:.1f} GiB" for e in over)
    fixes = memory_suggestions(job, worst.stage, layout=layout, gpu=gpu)[:3]  # the three cheapest
    fix = "; ".join(fixes + ["or more model parallelism (python -m tools.plan lists the layouts that fit)"])
    raise ConfigError(
        f"{source}: the predicted peak per rank does not fit the {gpu.name} on pipeline {peaks} (stage "
        f"{worst.stage} needs {worst.total * (1 + gpu.fragmentation) / GIB:.1f} GiB with the "
        f"{100 * gpu.fragmentation:.0f}% allocator overhead; the {_capacity(gpu)}); the three cheapest "
        f"fixes, by GiB saved per second of step time: {fix}"
    )


def device_line(gpu: Optional[GPUSpec], source: str, worst: MemoryEstimate) -> str:
    """The dry run's line saying what the job's memory was checked against, and the margin left."""
    if gpu is None:
        return f"  device      {source}: memory not checked (set parallel.gpu={'|'.join(list_gpus())} to check)"
    need = worst.total * (1 + gpu.fragmentation) / GIB
    return (
        f"  device      {source}: fits (stage {worst.stage} needs {need:.1f} GiB with the "
        f"{100 * gpu.fragmentation:.0f}% allocator overhead; the {_capacity(gpu)})"
    )
