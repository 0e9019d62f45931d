"""What this machine runs: the training device, and the experts' backend on it.

:func:`~folding.job.validate.validate_job` checks a job against a world size only (a dry run
plans a cluster from a laptop); what depends on the machine itself is checked here, by the entry
point (:func:`folding.launch.cli.check_command_line`) and by
:func:`folding.training.trainer.prepare`, before any process group exists: the expert backend
(``moe.expert_backend``) must run the FP8 recipe (``moe.fp8_recipe``) on this device at the job's
precision (``train.precision``), with the reason and the fix when it cannot
(:mod:`folding.moe.experts.select`). ``auto`` resolves here as the experts will, and the run says
which backend at start.

Usage::

    name = check_experts_here(job)          # e.g. "torch"; raises ConfigError when it cannot run
    cuda_device_here()                      # ("NVIDIA H100 80GB HBM3", 85...) or None on a CPU machine
    print(experts_summary(job, name))       # experts: moe.expert_backend=auto -> torch (...)
"""

from __future__ import annotations

import os
import warnings
from typing import Optional, Tuple

import torch

from ..moe.experts.select import BackendError, resolve_backend
from .config import ConfigError, JobConfig


def training_device() -> torch.device:
    """``cuda:<LOCAL_RANK>`` when CUDA is available, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def cuda_device_here() -> Optional[Tuple[str, int]]:
    """Name and total memory in bytes of this machine's first CUDA device
    (``torch.cuda.get_device_properties(0)``), or ``None`` without CUDA (never an error on a CPU machine).
    The dry run checks a job's memory against it when ``parallel.gpu`` is null."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return str(props.name), int(props.total_memory)


def compute_dtype(job: JobConfig) -> torch.dtype:
    """The dtype the model computes in: ``train.precision`` (``bf16`` or ``fp32``)."""
    return torch.bfloat16 if job.train.precision == "bf16" else torch.float32


def resolve_expert_backend(job: JobConfig, device: torch.device, *, quiet: bool = False) -> str:
    """The one decision of the backend the job's experts run on ``device`` at the job's precision:
    ``moe.expert_backend`` checked, or what ``auto`` picks there
    (:func:`folding.moe.experts.select.resolve_backend`, TransformerEngine's own checks). ``quiet``
    leaves ``auto``'s fallback warning to the run (validation asks before the run says it). Raises
    :class:`~folding.moe.experts.select.BackendError` when a named backend cannot run here. The
    name is handed to the model build (:class:`folding.moe.settings.LayerSettings`), which does not
    decide again."""
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        return resolve_backend(job.moe.expert_backend, job.moe.fp8_recipe, torch.device(device), compute_dtype(job))


def check_experts_here(job: JobConfig, device: Optional[torch.device] = None) -> str:
    """The expert backend that runs ``job`` on ``device`` (default: this process's training device).

    Raises :class:`~folding.job.config.ConfigError` naming ``moe.expert_backend``,
    ``moe.fp8_recipe``, the reason and the fix when a named backend cannot run the recipe here (for
    example ``torch`` + ``rowwise`` without a GPU of compute capability 9.x).
    """
    device = training_device() if device is None else torch.device(device)
    try:
        return resolve_expert_backend(job, device)
    except BackendError as e:
        raise ConfigError(f"{e} (train.precision={job.train.precision})") from None


def experts_summary(job: JobConfig, backend: str, device: Optional[torch.device] = None) -> str:
    """One line for the run's start: the backend asked for, the one that runs, the recipe and device."""
    device = training_device() if device is None else torch.device(device)
    return (
        f"experts: moe.expert_backend={job.moe.expert_backend} -> {backend} "
        f"(moe.fp8_recipe={job.moe.fp8_recipe}, {device}, train.precision={job.train.precision})"
    )
