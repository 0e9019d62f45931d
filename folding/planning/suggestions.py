"""What would make one pipeline stage of a job hold less memory, ranked by bytes saved per second of step time.

The dry run's memory check lists these when a stage does not fit the GPU. Each candidate is a change of
the job's settings, written as the override that makes it: each recompute module the job does not use yet
(:mod:`folding.model.recompute`), and the whole layer (``train.recompute=full``). Each is scored on the
stage by the bytes it saves (:func:`~folding.planning.job_memory.job_memory`) and the step time it adds
(:func:`~folding.planning.step_time.estimate_step_time` of the job's layout, with the planner's calibrated
compute efficiency), and the list runs from the most bytes saved per extra second (a change that adds no
time comes first) down, the changes that make the stage fit the GPU (when one is given) before the others;
a change that saves nothing is left out.

Usage::

    for line in memory_suggestions(job, 0, layout=layout, gpu=get_gpu("h100")):
        print(line)
    # recipes=mixtral_8x7b parallel.vpp=null train.micro_batch_size=2 (stage 0: 79.9 GiB), first line:
    # train.recompute=full: 55.2 GiB less on stage 0 (24.7 GiB, fits the h100) for +1.102 s per step (50 GiB per second)
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Tuple

from folding.model.config import OFFLOAD_MODULES, RECOMPUTE_MODULES, offload_conflict, recompute_spec

from .hardware import GIB, GPUSpec, get_gpu
from .job_memory import job_memory
from .optim_precision import OptimizerPrecision
from .planner import COMPUTE_EFFICIENCY, planned_dispatcher
from .step_time import Cluster, Plan, TrainingShape, estimate_step_time

REFERENCE_GPU = "h100"
"""The GPU kind whose step time prices a change when the job names none."""


def job_plan(job, layout) -> Plan:
    """The cost model's :class:`~folding.planning.step_time.Plan` of ``job`` on ``layout`` (the engine's
    folded layout, its knobs from ``parallel.*``, ``optim.distributed`` and ``train.recompute``)."""
    return Plan(
        tp=layout.tp,
        cp=layout.cp,
        pp=layout.pp,
        vpp=layout.vpp or 1,
        ep=layout.ep,
        etp=layout.etp,
        dp=layout.dp,
        edp=layout.edp,
        distributed_optimizer=job.optim.distributed,
        recompute=job.train.recompute_setting(),
        offload=job.train.offload_setting(),
        last_stage_layers=layout.last_stage_layers,
        first_stage_layers=layout.first_stage_layers,
        pipeline_layout=layout.pipeline_layout,
        overlap_moe_comm=job.parallel.overlap_moe_comm,
        delay_wgrad=job.parallel.delay_wgrad,
        dispatcher=planned_dispatcher(job.model),
    )


def job_step_seconds(job, layout, gpu: GPUSpec) -> float:
    """Predicted seconds of one optimizer step of ``job`` on ``layout`` with ``gpu`` (the planner's cost
    model; ``parallel.nvlink_domain`` GPUs per node, 8 when null)."""
    t = job.train
    cluster = Cluster(gpu=gpu, num_gpus=layout.world_size, nvlink_domain=job.parallel.nvlink_domain or 8)
    shape = TrainingShape(
        seq_length=t.seq_length,
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        optim_precision=OptimizerPrecision.of(job.optim),
        fp8_recipe=job.moe.fp8_recipe,
    )
    plan = job_plan(job, layout)
    time = estimate_step_time(job.model, plan, shape=shape, cluster=cluster, compute_efficiency=COMPUTE_EFFICIENCY)
    return time.step_s


def candidates(job) -> List[Tuple[str, object]]:
    """``(override, changed job)`` for every change :func:`memory_suggestions` weighs: each recompute module
    (:data:`~folding.model.recompute.RECOMPUTE_MODULES`) the job does not recompute yet, added to
    ``train.recompute_modules``; each offload module (:data:`~folding.memory.offload.OFFLOAD_MODULES`) not
    offloaded yet, added to ``train.offload_modules``; and ``train.recompute=full`` (the whole layer). A change
    the job's validation would refuse (an offload module whose tensors a recompute module already drops) is
    left out."""
    t = job.train
    rc = recompute_spec(t.recompute, t.recompute_modules)
    out = []
    if rc.whole_layer:
        return out
    for module in RECOMPUTE_MODULES:
        if module not in rc.modules:
            mods = [*t.recompute_modules, module]
            out.append((f"train.recompute_modules=[{','.join(mods)}]", dataclasses.replace(t, recompute_modules=mods)))
    for module in OFFLOAD_MODULES:
        if module not in t.offload_modules:
            mods = [*t.offload_modules, module]
            out.append((f"train.offload_modules=[{','.join(mods)}]", dataclasses.replace(t, offload_modules=mods)))
    if not t.offload_modules:
        full = dataclasses.replace(t, recompute="full", recompute_modules=[])
        out.append(
            ("train.recompute=full train.recompute_modules=[]" if t.recompute_modules else "train.recompute=full", full)
        )
    return [
        (override, dataclasses.replace(job, train=train))
        for override, train in out
        if not offload_conflict(recompute_spec(train.recompute, train.recompute_modules), train.offload_modules)
    ]


def memory_suggestions(job, stage: int, *, layout=None, gpu: Optional[GPUSpec] = None) -> List[str]:
    """Changes that lower the predicted peak of pipeline ``stage`` of ``job``, best first (see the module
    docstring): ``"<override>: <GiB> less on stage <k> (<GiB after>[, fits the <gpu>]) for <+s> per step
    (<GiB> per extra second)"``.

    ``layout``: the job's validated layout (default: ``job.layout(job.parallel.world_size)``); ``gpu``: the
    GPU the stage must fit (whether each change makes it fit is said) and whose speed prices the change
    (default: :data:`REFERENCE_GPU`'s speed, and no verdict)."""
    if layout is None:
        layout = job.layout(job.parallel.world_size)
    clock = gpu or get_gpu(REFERENCE_GPU)
    before = job_memory(job, layout, stage=stage).total
    base_s = job_step_seconds(job, layout, clock)
    scored = []
    for override, changed in candidates(job):
        after = job_memory(changed, layout, stage=stage).total
        saved = before - after
        if saved <= 0:
            continue
        extra = job_step_seconds(changed, layout, clock) - base_s
        rate = saved / extra if extra > 1e-9 else math.inf
        verdict = "" if gpu is None else f", {'fits' if gpu.fits(after) else 'still over'} the {gpu.name}"
        cost = (
            "at no extra step time"
            if rate == math.inf
            else f"for {extra:+.3f} s per step ({rate / GIB:.0f} GiB per second)"
        )
        fits = gpu is not None and gpu.fits(after)
        scored.append(
            (
                fits,
                rate,
                f"{override}: {saved / GIB:.1f} GiB less on stage {stage} ({after / GIB:.1f} GiB{verdict}) {cost}",
            )
        )
    # with a GPU: the changes that make the stage fit first, each group from the most GiB per second down
    return [text for _, _, text in sorted(scored, key=lambda s: (not s[0], -s[1]))]
