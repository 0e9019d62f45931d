"""Speed and memory of a training step: tokens/s, model TFLOP/s per device, MFU, peak memory.

The model FLOPs per token come from :func:`folding.planning.flops.flops_per_token` (the training
FLOPs of the model, recompute excluded), the peak from ``logging.peak_tflops`` or, on a known GPU
kind, :mod:`folding.planning.hardware`. Peak memory is the device's allocator peak on CUDA and the
process's maximum resident set on CPU, maximized over the world.

Usage::

    throughput = Throughput(job, device=device, world_size=dist.get_world_size())
    record.update(throughput.measure(seconds))     # collective: one all-reduce (max) of the memory
"""

from __future__ import annotations

import resource
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from ..job.config import JobConfig
from ..planning.flops import flops_per_token
from ..planning.hardware import get_gpu


def memory_gib(device: torch.device) -> float:
    """This process's peak memory in GiB: CUDA's peak allocation, or the maximum resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def peak_tflops(job: JobConfig, device: torch.device) -> Optional[float]:
    """Peak dense TFLOP/s of one device: ``logging.peak_tflops`` if set, else the BF16 peak of a known
    CUDA GPU kind, else ``None`` (no MFU is reported)."""
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


class Throughput:
    """Turns a step's wall-clock time into the speed and memory fields of the ``train`` record."""

    def __init__(self, job: JobConfig, *, device: torch.device, world_size: int):
        """``job`` gives the model, the tokens per global batch and the peak; ``world_size`` the devices."""
        self.device = device
        self.world_size = world_size
        self.tokens_per_step = job.train.global_batch_size * job.train.seq_length
        self.flops_per_token = flops_per_token(job.model, job.train.seq_length).model_training
        self.peak_tflops = peak_tflops(job, device)

    def measure(self, seconds: float) -> Dict[str, Any]:
        """``step_time_s``, ``tokens_per_s``, ``tflops_per_device``, ``mfu`` (``None`` without a peak)
        and ``mem_gib`` (the largest peak memory of any rank). Collective over the world."""
        mem = torch.tensor([memory_gib(self.device)], dtype=torch.float64, device=self.device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        tokens_per_s = self.tokens_per_step / seconds
        tflops = self.flops_per_token * tokens_per_s / self.world_size / 1e12
        return {
            "step_time_s": seconds,
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
            "mem_gib": float(mem),
        }
