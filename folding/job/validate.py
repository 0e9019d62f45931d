"""Cross-section checks of a job, run before any process group exists.

The typed sections validate their own fields when built; :func:`validate_job` checks what needs
several sections at once (the layout against the model, the batch sizes against DP, the sequence
length against TP/CP, ...) for a given world size, and returns the validated layout.

Usage::

    layout = validate_job(job, world_size=int(os.environ.get("WORLD_SIZE", 1)))
    layout = validate_job(job, world_size=8, device=torch.device("cuda", 0))   # also resolves moe.expert_backend=auto

Every failure raises :class:`~folding.job.config.ConfigError` naming the setting and a fix.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from ..memory.offload import OFFLOAD_MODULES
from ..model.recompute import RECOMPUTE_MODULES, offload_conflict, recompute_spec
from ..moe.experts.fp8_shapes import check_fp8_shapes
from ..parallel import LayoutError, ParallelLayout
from ..parallel.partition import layout_stages
from .config import PRECISIONS, RECOMPUTE_MODES, WANDB_MODES, ConfigError, JobConfig, _fail, _int_at_least
from .machine import resolve_expert_backend


def _check_optim_precision(job: JobConfig) -> None:
    """bf16 master weights need bf16 parameters: under fp32 training every parameter is its own fp32
    master, and ``optim.main_params_dtype=bf16`` would silently do nothing."""
    if job.optim.main_params_dtype == "bf16" and job.train.precision != "bf16":
        _fail(
            "optim.main_params_dtype",
            job.optim.main_params_dtype,
            f"keeps bf16 master weights of bf16 parameters, but train.precision={job.train.precision} "
            f"trains fp32 parameters (their own fp32 masters)",
            "set train.precision=bf16, or optim.main_params_dtype=fp32",
        )


def _check_train(job: JobConfig) -> None:
    t = job.train
    for key in ("steps", "global_batch_size", "micro_batch_size", "seq_length"):
        _int_at_least(f"train.{key}", getattr(t, key), 1)
    _int_at_least("train.eval_interval", t.eval_interval, 0)
    _int_at_least("train.eval_steps", t.eval_steps, 0)
    if t.eval_interval > 0 and t.eval_steps < 1:
        _fail(
            "train.eval_steps",
            t.eval_steps,
            "must be >= 1 when train.eval_interval > 0",
            "set train.eval_steps >= 1 or train.eval_interval=0",
        )
    if isinstance(t.seed, bool) or not isinstance(t.seed, int):
        _fail("train.seed", t.seed, "must be an integer", "set train.seed to an integer")
    if t.precision not in PRECISIONS:
        _fail("train.precision", t.precision, "unknown precision", f"choose one of {', '.join(PRECISIONS)}")
    if t.recompute not in RECOMPUTE_MODES:
        _fail("train.recompute", t.recompute, "unknown mode", f"choose one of {', '.join(RECOMPUTE_MODES)}")
    _check_recompute_modules(t)
    _check_offload_modules(t)
    moe = job.moe
    par = job.parallel
    for key in ("overlap_moe_comm", "delay_wgrad"):
        if not isinstance(getattr(par, key), bool):
            _fail(f"parallel.{key}", getattr(par, key), "must be true or false", f"set parallel.{key}=true or false")
    nv = par.nvlink_domain
    if nv is not None and (isinstance(nv, bool) or not isinstance(nv, int) or nv < 1):
        _fail(
            "parallel.nvlink_domain",
            nv,
            "must be an integer >= 1 (ranks per node)",
            "set it to the ranks per node (torchrun's --nproc-per-node) or null",
        )
    if par.delay_wgrad and not par.overlap_moe_comm:
        _fail(
            "parallel.delay_wgrad",
            par.delay_wgrad,
            "delays the experts' weight gradients behind the exchanges that parallel.overlap_moe_comm overlaps",
            "set parallel.overlap_moe_comm=true as well, or parallel.delay_wgrad=false",
        )
    if par.delay_wgrad and moe.expert_backend not in ("torch", "auto"):
        _fail(
            "parallel.delay_wgrad",
            par.delay_wgrad,
            f"is implemented for the torch grouped-GEMM backend, not moe.expert_backend={moe.expert_backend!r}",
            "set moe.expert_backend=torch (or auto), or parallel.delay_wgrad=false",
        )
    if t.threads is not None:
        _int_at_least("train.threads", t.threads, 1)
    tmo = t.collective_timeout_s
    if isinstance(tmo, bool) or not isinstance(tmo, (int, float)) or not math.isfinite(tmo) or tmo <= 0:
        _fail(
            "train.collective_timeout_s",
            tmo,
            "must be a positive number of seconds",
            "set e.g. train.collective_timeout_s=600",
        )
    if t.seq_length > job.model.max_position_embeddings:
        _fail(
            "train.seq_length",
            t.seq_length,
            f"exceeds model.max_position_embeddings={job.model.max_position_embeddings}",
            "lower train.seq_length or raise model.max_position_embeddings",
        )


def _check_logging_and_checkpoint(job: JobConfig) -> None:
    lg, ck = job.logging, job.checkpoint
    _int_at_least("logging.interval", lg.interval, 1)
    if lg.wandb.mode not in WANDB_MODES:
        _fail("logging.wandb.mode", lg.wandb.mode, "unknown mode", f"choose one of {', '.join(WANDB_MODES)}")
    if not lg.metrics_file:
        _fail("logging.metrics_file", lg.metrics_file, "must name a file", "e.g. logging.metrics_file=metrics.jsonl")
    if os.path.isdir(os.path.expanduser(lg.metrics_file)):
        _fail("logging.metrics_file", lg.metrics_file, "is a directory", "give a file path")
    if lg.peak_tflops is not None and not (isinstance(lg.peak_tflops, (int, float)) and lg.peak_tflops > 0):
        _fail("logging.peak_tflops", lg.peak_tflops, "must be positive or null", "e.g. logging.peak_tflops=989")
    if ck.save_interval is not None:
        _int_at_least("checkpoint.save_interval", ck.save_interval, 1)
        if not ck.dir:
            _fail(
                "checkpoint.save_interval",
                ck.save_interval,
                "is set but checkpoint.dir is not",
                "set checkpoint.dir=<directory> or checkpoint.save_interval=null",
            )
    if ck.keep_last is not None:
        _int_at_least("checkpoint.keep_last", ck.keep_last, 1)
    if not isinstance(ck.async_save, bool):
        _fail(
            "checkpoint.async_save", ck.async_save, "must be true or false", "set checkpoint.async_save=true or false"
        )
    if ck.init_from_hf is not None:
        if not isinstance(ck.init_from_hf, str) or not os.path.exists(os.path.expanduser(ck.init_from_hf)):
            _fail(
                "checkpoint.init_from_hf",
                ck.init_from_hf,
                "does not exist",
                "give a Hugging Face checkpoint directory (config.json + safetensors) or a file of "
                "tools/convert_hf.py import, or checkpoint.init_from_hf=null",
            )
        if ck.load is not None:
            _fail(
                "checkpoint.init_from_hf",
                ck.init_from_hf,
                f"and checkpoint.load={ck.load!r} both choose the starting weights",
                "keep checkpoint.load to resume a run of this engine, or checkpoint.init_from_hf to "
                "start one from Hugging Face weights (set the other to null)",
            )
    if ck.init_from_megatron is not None:
        _check_megatron_source(ck)
    if ck.load is not None and not os.path.exists(os.path.expanduser(ck.load)):
        _fail(
            "checkpoint.load",
            ck.load,
            "does not exist",
            "give an existing checkpoint or directory of checkpoints, or checkpoint.load=null",
        )
    if ck.dir and os.path.exists(ck.dir) and not os.path.isdir(ck.dir):
        _fail("checkpoint.dir", ck.dir, "exists and is not a directory", "choose another checkpoint.dir")


MEGATRON_MARKERS = (".metadata", "latest_checkpointed_iteration.txt")
"""Files one of which a Megatron-Core ``torch_dist`` checkpoint directory holds: the DCP store's metadata
(an ``iter_<N>`` directory) or Megatron-LM's tracker of the latest iteration (the ``--save`` directory)."""


def _check_megatron_source(ck) -> None:
    """``checkpoint.init_from_megatron`` names a torch_dist checkpoint directory and is the only start."""
    path = ck.init_from_megatron
    if not isinstance(path, str) or not os.path.isdir(os.path.expanduser(path)):
        _fail(
            "checkpoint.init_from_megatron",
            path,
            "is not a directory",
            "give the directory Megatron saved into (--save) or one of its iter_<N> directories, "
            "or checkpoint.init_from_megatron=null",
        )
    if not any(os.path.isfile(os.path.join(os.path.expanduser(path), m)) for m in MEGATRON_MARKERS):
        _fail(
            "checkpoint.init_from_megatron",
            path,
            f"is not a Megatron-Core torch_dist checkpoint (it holds neither of {', '.join(MEGATRON_MARKERS)})",
            "give the directory Megatron saved into (--save, --ckpt-format torch_dist) or one of its iter_<N> "
            "directories",
        )
    for other in ("load", "init_from_hf"):
        if getattr(ck, other) is not None:
            _fail(
                "checkpoint.init_from_megatron",
                path,
                f"and checkpoint.{other}={getattr(ck, other)!r} both choose the starting weights",
                f"set one of them to null (checkpoint.{other}=null to start from the Megatron checkpoint)",
            )


def _check_tokenizer(job: JobConfig) -> None:
    """The tokenizer must be on disk (the real start loads it; the dry run refuses what it would)."""
    tok = job.data.tokenizer
    if isinstance(tok, str) and tok != "byte" and not os.path.exists(os.path.expanduser(tok)):
        _fail(
            "data.tokenizer",
            tok,
            "does not exist (tokenizers load from disk only, never over the network)",
            "give 'byte' or a local tokenizer directory / tokenizer.json (a Hugging Face hub name: "
            "download it first, e.g. huggingface-cli download NAME --local-dir DIR, then data.tokenizer=DIR)",
        )


def expert_backend_on(job: JobConfig, device: Optional[torch.device]) -> str:
    """The expert backend the job's experts run on ``device``: ``moe.expert_backend`` itself, or what
    ``auto`` resolves to there (:func:`folding.job.machine.resolve_expert_backend`, the one decision;
    its fallback warning is left to the run). Without a device, ``auto`` stays ``auto``."""
    moe = job.moe
    if moe.expert_backend != "auto" or device is None:
        return moe.expert_backend
    return resolve_expert_backend(job, device, quiet=True)


def _check_recompute_modules(t) -> None:
    """``train.recompute_modules``: a list of known module names, not with ``full``, and no discarding
    module inside ``train.compile``'s compiled attention sublayer (its storages are freed and refilled
    outside the graph the compiler sees)."""
    mods = t.recompute_modules
    if not isinstance(mods, (list, tuple)) or not all(isinstance(m, str) for m in mods):
        _fail(
            "train.recompute_modules",
            mods,
            "must be a list of module names",
            f"name some of {', '.join(RECOMPUTE_MODULES)}, e.g. train.recompute_modules=[moe_act]",
        )
    try:
        t.recompute_setting()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    clash = [m for m in ("layernorm", "mla_up_proj") if m in mods]
    if t.compile and clash:
        _fail(
            "train.recompute_modules",
            list(mods),
            f"{', '.join(clash)} discard(s) tensors of the attention sublayer, which train.compile=true compiles",
            f"drop {', '.join(clash)} or set train.compile=false",
        )


def _check_offload_modules(t) -> None:
    """``train.offload_modules``: a list of known module names that the recompute setting leaves something
    to move (:func:`folding.model.recompute.offload_conflict`)."""
    mods = t.offload_modules
    if not isinstance(mods, (list, tuple)) or not all(isinstance(m, str) for m in mods):
        _fail(
            "train.offload_modules",
            mods,
            "must be a list of module names",
            f"name some of {', '.join(OFFLOAD_MODULES)}",
        )
    bad = [m for m in mods if m not in OFFLOAD_MODULES]
    if bad:
        _fail(
            "train.offload_modules",
            list(mods),
            f"unknown module(s) {bad}",
            f"choose among {', '.join(OFFLOAD_MODULES)}",
        )
    compiled = [m for m in mods if m in ("attn_norm", "qkv_linear", "core_attn", "attn_proj")]
    if t.compile and compiled:
        _fail(
            "train.offload_modules",
            list(mods),
            f"{', '.join(compiled)} offload(s) tensors of the attention sublayer, which train.compile=true compiles",
            f"drop {', '.join(compiled)} or set train.compile=false",
        )
    why = offload_conflict(recompute_spec(t.recompute, t.recompute_modules), mods)
    if why:
        _fail(
            "train.offload_modules",
            list(mods),
            why,
            "drop the module from train.offload_modules or the recompute setting that empties it",
        )


def _check_recompute_vs_fp8_region(job: JobConfig, device: Optional[torch.device]) -> None:
    """``delayed`` on TE needs every expert forward inside the chunk's FP8 region; a recomputed expert
    forward runs in backward, outside it. Checked on the backend the experts will really run."""
    t, moe = job.train, job.moe
    if t.recompute not in ("full", "moe") and "moe" not in t.recompute_modules or moe.fp8_recipe != "delayed":
        return
    backend = expert_backend_on(job, device)
    if backend == "te":
        how = "moe.expert_backend='te'" if moe.expert_backend == "te" else f"moe.expert_backend='auto' (te on {device})"
        _fail(
            "train.recompute",
            t.recompute,
            f"recomputes the experts outside the FP8 region that moe.fp8_recipe='delayed' needs with {how}",
            "use train.recompute=selective or none, or moe.fp8_recipe=tensorwise/blockwise/mxfp8",
        )


def _check_overlap_vs_te_fp8(job: JobConfig, device: Optional[torch.device]) -> None:
    """TransformerEngine's FP8 autocast state is process-global, not per thread (region depth, the
    region's first FP8 module, the amax-reduction buffers), and the chunk's FP8 region stays open
    across the MoE exchanges, where the two lanes of an overlap pair hand over: the other lane would
    run inside it. Checked on the backend the experts will really run (BF16 on te opens no region)."""
    par, moe = job.parallel, job.moe
    if not par.overlap_moe_comm or moe.fp8_recipe is None or expert_backend_on(job, device) != "te":
        return
    how = "moe.expert_backend='te'" if moe.expert_backend == "te" else f"moe.expert_backend='auto' (te on {device})"
    _fail(
        "parallel.overlap_moe_comm",
        par.overlap_moe_comm,
        f"cannot run with {how} and moe.fp8_recipe={moe.fp8_recipe!r}: TransformerEngine keeps its FP8 "
        "autocast state (region depth, first FP8 module, amax-reduction buffers) per process, not per thread, "
        "and a model chunk's FP8 region stays open across the MoE exchanges where the two micro-batches of an "
        "overlap pair hand over, so the other one would run inside it",
        "set parallel.overlap_moe_comm=false, or moe.expert_backend=torch (the rowwise and mxfp8 recipes through "
        "torch._scaled_grouped_mm) or emulated",
    )


def _check_replicas(job: JobConfig, layout: ParallelLayout, device: Optional[torch.device]) -> None:
    """``moe.expert_replicas`` against the layout and the backend the experts run."""
    moe = job.moe
    R = moe.expert_replicas
    if not R or not any(job.model.is_moe_layer(i) for i in job.model.layer_numbers()):
        return
    if layout.ep < 2:
        _fail(
            "moe.expert_replicas",
            R,
            f"needs expert parallelism, but parallel.ep={layout.ep} puts every expert on every rank",
            "set parallel.ep > 1 or moe.expert_replicas=0",
        )
    if expert_backend_on(job, device) == "te":
        _fail(
            "moe.expert_replicas",
            R,
            f"needs a backend with a variable number of experts, and the experts run on te on {device}",
            "set moe.expert_backend=torch or moe.expert_replicas=0",
        )


def _check_layout_vs_model(job: JobConfig, layout: ParallelLayout) -> None:
    m, t, tp, cp = job.model, job.train, layout.tp, layout.cp
    try:
        m.check_divisible(tp=tp, ep=layout.ep, etp=layout.etp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if any(m.is_moe_layer(i) for i in m.layer_numbers()):
        try:
            check_fp8_shapes(
                job.moe.fp8_recipe,
                hidden_size=m.hidden_size,
                ffn_hidden_size=job.moe.ffn_hidden_size,
                etp=layout.etp,
                backend=job.moe.expert_backend,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
    chunk = 2 * cp if cp > 1 else 1
    if t.seq_length % (chunk * tp):
        _fail(
            "train.seq_length",
            t.seq_length,
            f"must be divisible by {chunk * tp} (2*cp*tp with context parallelism, tp with sequence "
            f"parallelism; parallel.tp={tp}, parallel.cp={cp})",
            f"use a multiple of {chunk * tp}",
        )
    per_step = t.micro_batch_size * layout.dp
    if t.global_batch_size % per_step:
        _fail(
            "train.global_batch_size",
            t.global_batch_size,
            f"is not divisible by train.micro_batch_size*DP = {t.micro_batch_size}*{layout.dp}",
            f"use a multiple of {per_step} (DP = world/(tp*cp*pp) = {layout.dp})",
        )
    num_micro = t.global_batch_size // per_step
    if layout.pp > 1 and (layout.vpp or 1) > 1 and num_micro % layout.pp:
        _fail(
            "train.global_batch_size",
            t.global_batch_size,
            f"gives {num_micro} micro-batches per replica, not a multiple of parallel.pp={layout.pp} "
            "(interleaved pipelining needs it)",
            "change the batch sizes or "
            + (
                "list parallel.pp stages in parallel.pipeline_layout (its stage count implies parallel.vpp)"
                if layout.pipeline_layout
                else "set parallel.vpp=null"
            ),
        )
    if layout.pipeline_layout is not None:  # its own messages name parallel.pipeline_layout and the fix
        try:
            _stage_ranges(m, layout)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    elif layout.pp > 1:
        try:
            _stage_ranges(m, layout)
        except ValueError as e:
            raise ConfigError(f"parallel.pp={layout.pp}/parallel.vpp={layout.vpp}: {e}") from None


def _stage_ranges(model, layout):
    """The layer ranges of ``layout``'s virtual stages for ``model`` (raises ``ValueError``)."""
    return layout_stages(layout, num_layers=model.num_layers, mtp_num_layers=model.mtp_num_layers)


def validate_job(job: JobConfig, *, world_size: int, device: Optional[torch.device] = None) -> ParallelLayout:
    """Check every cross-section constraint of ``job`` on ``world_size`` ranks; return the layout.

    ``device``: where this process's experts will run (the training device); with it, the checks that
    depend on the expert backend see what ``moe.expert_backend=auto`` resolves to there (the dry run,
    which may run elsewhere, passes none and checks the backend as written).
    Pure: no process group, no file written. Raises :class:`ConfigError`.
    """
    ws = job.parallel.world_size
    if ws is not None:
        _int_at_least("parallel.world_size", ws, 1)
        if ws != world_size:
            _fail(
                "parallel.world_size",
                ws,
                f"but the job was launched on {world_size} rank{'' if world_size == 1 else 's'}",
                f"launch {ws} rank{'' if ws == 1 else 's'} (torchrun --nproc-per-node ...) "
                "or set parallel.world_size=null",
            )
    _check_train(job)
    _check_recompute_vs_fp8_region(job, device)
    _check_overlap_vs_te_fp8(job, device)
    _check_logging_and_checkpoint(job)
    _check_tokenizer(job)
    try:
        layout = job.layout(world_size)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    _check_layout_vs_model(job, layout)
    _check_replicas(job, layout, device)
    try:
        job.optim.validate(train_steps=job.train.steps)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_optim_precision(job)
    return layout
