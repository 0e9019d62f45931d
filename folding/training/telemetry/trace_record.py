"""Recording the routing trace during training (``moe.trace_dir``; the file: :mod:`.trace_file`).

Every rank holds, from :class:`~folding.training.telemetry.moe_stats.MoEStats`, the rows its tokens sent to
each expert and the pairs dropped, per MoE layer of the whole model (zeros for the layers of other
pipeline stages). Once per step :meth:`RoutingTracer.gather` packs them as int32 ``[2, L, E]`` and
gathers them on rank 0 over the world (one collective, issued before the step's world all-reduce so
that its host read covers it); after that read :meth:`RoutingTracer.write` has rank 0 copy the
gathered ``[R, 2, L, E]`` to the host and append the record ``[L, R, E]`` counts and drops.

Usage::

    tracer = RoutingTracer.start(job, layout, rank=r, world_size=R, start_step=s)   # None when off
    tracer.gather(stats)            # every rank, in the step's reduction phase
    tracer.write(step)              # every rank (rank 0 writes)
    tracer.close()
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch
import torch.distributed as dist

from ...job.config import ConfigError, JobConfig
from ...parallel import ParallelLayout
from .moe_stats import MoEStats
from .trace_file import TraceWriter, check_resume, make_header, trace_path


def trace_header(job: JobConfig, layout: ParallelLayout, *, world_size: int) -> dict:
    """The trace header of ``job`` run in ``layout`` on ``world_size`` ranks."""
    m = job.model
    layers = [i for i in m.layer_numbers() if m.is_moe_layer(i)]
    sizes = {k: getattr(layout, k) for k in ("tp", "cp", "dp", "pp", "vpp", "ep", "etp", "edp")}
    return make_header(
        model=m.name,
        layer_numbers=layers,
        num_experts=m.moe.num_experts,
        topk=m.moe.topk,
        source_ranks=world_size,
        layout={**sizes, "order": layout.order, "world_size": world_size},
    )


def check_trace_dir(job: JobConfig, layout: ParallelLayout, *, world_size: int, resuming: bool) -> None:
    """Before any collective: a resumed run must be able to append to ``moe.trace_dir``'s trace
    (:class:`ConfigError` naming the setting otherwise). A fresh run replaces the file."""
    d = job.moe.trace_dir
    if not d or not resuming:
        return
    reason = check_resume(trace_path(d), trace_header(job, layout, world_size=world_size))
    if reason:
        raise ConfigError(
            f"moe.trace_dir={d!r}: {reason}, so this resumed run cannot append to it; "
            "set moe.trace_dir to another directory (one trace file per geometry)"
        )


@dataclasses.dataclass
class RoutingTracer:
    """One rank's part of the trace (see the module docstring)."""

    rank: int
    world_size: int
    writer: Optional[TraceWriter]
    """Rank 0's file; ``None`` on the other ranks."""
    pending: Optional[List[torch.Tensor]] = None

    @classmethod
    def start(
        cls, job: JobConfig, layout: ParallelLayout, *, rank: int, world_size: int, start_step: int
    ) -> Optional["RoutingTracer"]:
        """The tracer of this rank, or ``None`` without ``moe.trace_dir``."""
        if not job.moe.trace_dir:
            return None
        writer = None
        if rank == 0:
            header = trace_header(job, layout, world_size=world_size)
            writer = TraceWriter(trace_path(job.moe.trace_dir), header, start_step=start_step)
        return cls(rank=rank, world_size=world_size, writer=writer)

    def gather(self, stats: MoEStats) -> None:
        """Collective over the world: gather every rank's ``[2, L, E]`` counts and drops on rank 0."""
        mine = torch.stack([stats.counts_LE, stats.dropped_LE]).to(torch.int32)
        if self.rank == 0:
            self.pending = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.gather(mine, self.pending, dst=0)

    def write(self, step: int) -> None:
        """Rank 0 appends the gathered record of ``step`` (after the step's host read)."""
        if self.writer is None or self.pending is None:
            return
        all_R2LE = torch.stack(self.pending).cpu().numpy()
        self.writer.append(step, all_R2LE[:, 0].transpose(1, 0, 2), all_R2LE[:, 1].transpose(1, 0, 2))
        self.pending = None

    def close(self) -> None:
        """Close rank 0's file."""
        if self.writer is not None:
            self.writer.close()
