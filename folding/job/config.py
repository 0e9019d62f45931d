"""The typed configuration of a training job: ``parallel.*``, ``train.*``, ``logging.*``, ``checkpoint.*``
composed with the model, MoE, optimizer and data sections.

Hydra composes ``configs/`` on top of the schema of :mod:`folding.job.schema`; the entry
point turns the composed tree into a plain ``dict`` once and calls :func:`job_config_from_dict`, which
returns a frozen-in-spirit :class:`JobConfig` of typed dataclasses. Nothing below the entry point sees
a ``DictConfig``.

- ``model``: a preset's fields (the presets of :mod:`folding.model.presets`, registered with Hydra
  by :mod:`folding.job.schema`), each overridable as ``model.<field>``.
- ``moe``: the preset's MoE record (:class:`folding.moe.config.MoEConfig`), each field overridable as
  ``moe.<field>``; the job's ``model.moe`` is built from it, so FLOPs, the memory model, the dry run
  and the planner read the same values as the layers.
- ``optim`` / ``data``: :class:`folding.optim.config.OptimConfig` and
  :class:`folding.data.config.DataConfig`.

Usage::

    job = job_config_from_dict(OmegaConf.to_container(cfg, resolve=True))
    validate_job(job, world_size=int(os.environ.get("WORLD_SIZE", 1)))   # before any process group
    layout = job.layout(world_size)

Every invalid setting raises :class:`ConfigError` (a ``ValueError``) naming ``<section>.<key>`` and a fix.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any, Dict, List, Mapping, Optional

from ..data.config import DataConfig
from ..memory.offload import OFFLOAD_MODULES
from ..model.config import ModelConfig
from ..model.mla_config import MLAConfig
from ..model.recompute import RECOMPUTE_MODES, recompute_spec  # noqa: F401 - the names train.recompute accepts
from ..model.yarn_config import YarnConfig
from ..moe.config import MoEConfig
from ..optim.config import OptimConfig
from ..parallel import DEFAULT_ORDER, ParallelLayout
from .learning_rate import resolve_learning_rate

PRECISIONS = ("fp32", "bf16")
WANDB_MODES = ("offline", "online", "disabled")
DEFAULT_WARMUP_STEPS = 5
"""``optim.warmup_steps`` when the job leaves it null, clamped by :func:`default_warmup_steps`."""


def default_warmup_steps(horizon: int) -> int:
    """The warm-up of a job that leaves ``optim.warmup_steps`` null: :data:`DEFAULT_WARMUP_STEPS`, at
    most half of the ``horizon``-step schedule (so that a 2-step smoke run still runs)."""
    if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
        return DEFAULT_WARMUP_STEPS  # validation names the bad train.steps / optim.decay_steps
    return min(DEFAULT_WARMUP_STEPS, horizon // 2)


class ConfigError(ValueError):
    """An invalid job setting; the message names the key (``train.steps``, ...) and a fix."""


def _fail(key: str, value: Any, why: str, fix: str) -> None:
    raise ConfigError(f"{key}={value!r}: {why}; {fix}")


def _int_at_least(key: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        _fail(key, value, f"must be an integer >= {low}", f"set {key} to an integer >= {low}")


# ---------------------------------------------------------------------------------------- sections
@dataclasses.dataclass(kw_only=True)
class ParallelConfig:
    """Folded layout sizes (``parallel.*``); DP and EDP are derived from the world size."""

    tp: int = 1
    """Attention tensor-parallel size (sequence parallelism is on whenever tp > 1)."""
    cp: int = 1
    """Attention context-parallel size."""
    pp: int = 1
    """Pipeline-parallel size (shared by attention and MoE)."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per rank (interleaved 1F1B); null for none."""
    ep: int = 1
    """Expert-parallel size."""
    etp: Optional[int] = None
    """Expert tensor-parallel size; null follows ``tp`` (write it explicitly: see the user guide)."""
    order: str = DEFAULT_ORDER
    """Axis order, fastest-varying first (Megatron-Core semantics)."""
    last_stage_layers: Optional[int] = None
    """Layers of the last pipeline stage, the others sharing the rest evenly (Megatron-Core's
    ``--decoder-last-pipeline-num-layers``); null: an even split. Needs pp > 1 without vpp."""
    first_stage_layers: Optional[int] = None
    """Layers of the first pipeline stage, the stages after it (up to the last, when
    ``last_stage_layers`` is set) sharing the rest evenly (Megatron-Core's
    ``--decoder-first-pipeline-num-layers``); null: as the others. Needs pp > 1 without vpp."""
    pipeline_layout: Optional[str] = None
    """What every virtual pipeline stage holds, as Megatron-Core's ``--pipeline-model-parallel-layout``
    writes it: ``E`` embedding, ``t`` transformer layer, ``m`` multi-token-prediction module, ``L`` loss,
    ``|`` between virtual stages (listed in model order: stage ``v`` on pipeline rank ``v % pp``),
    ``x*N`` and ``(...)*N`` repetition, e.g. ``Et|(tt|)*30mL`` (DeepSeek-V3 on pp8: 32 stages, vpp4).
    Stages may hold different numbers of layers, or none. The stage count over ``pp`` implies ``vpp``
    (a given ``vpp`` must agree); not with ``first_stage_layers`` / ``last_stage_layers``. null: the
    even split (or the one those two give)."""
    overlap_moe_comm: bool = False
    """Hide the MoE token exchanges behind compute: in the steady state of every schedule the forward
    of one micro-batch and the backward of another run merged, taking turns at each exchange (the EP
    all-to-all and, with ETP, its all-gather / reduce-scatter overlap alike), and the shared expert runs
    before its dispatch's count read. Same numbers bitwise; a longer warm-up keeps more activations in
    flight (one more chunk with virtual stages, ``2·(pp − rank)`` micro-batches under plain 1F1B, two
    without pipelining; docs/training.md, "Hiding MoE communication"). Every process-group role both
    lanes use gets a communicator of its own (``build_parallel_state(own_communicators=True)``), which
    costs NCCL buffer memory per extra communicator (docs/training.md, "A communicator per concurrent
    role")."""
    delay_wgrad: bool = False
    """With ``overlap_moe_comm``: compute the weight gradients while the backward's next exchange is in
    flight instead of before it (Megatron-Core's ``--delay-wgrad-compute``): the experts' behind the
    backward dispatch all-to-all, and those of attention's projections, the shared expert and a dense
    MLP behind the combine of the layer below (:mod:`folding.overlap.wgrad`); same numbers bitwise."""
    nvlink_domain: Optional[int] = None
    """Ranks that share the fast link, i.e. ranks per node (a GB200 NVL72 rack counts as one node):
    global rank ``r`` is on node ``r // nvlink_domain``. Read by ``moe.dispatcher=hierarchical``,
    which sends a token across the node boundary once per destination node; every node must hold the
    same number of ranks of each EP group. null: torchrun's ``LOCAL_WORLD_SIZE``, else the whole
    world (one node). Tests set it smaller to make one machine several nodes."""
    world_size: Optional[int] = None
    """The world size this layout is meant for. null: the launched world (torchrun's WORLD_SIZE). Set
    (as recipes do), a launch with another number of ranks fails; the dry run uses it."""
    gpu: Optional[str] = None
    """The GPU kind the job is meant for: ``h100`` (80 GB), ``h200`` (141 GB) or ``b200`` (180 GB), the
    planner's table (:mod:`folding.planning.hardware`). The dry run and the launch refuse a job whose predicted
    peak memory per rank does not fit in it (before any process group starts), naming the stages and what would
    make them fit. null: only the dry run checks, against this
    machine's CUDA device (matched to a kind of the table by name and memory, else its own memory), and
    no memory check on a machine without one."""

    def resolved_nvlink_domain(self, world_size: int) -> int:
        """Ranks per node: ``nvlink_domain``, else torchrun's ``LOCAL_WORLD_SIZE``, else ``world_size``."""
        if self.nvlink_domain is not None:
            return self.nvlink_domain
        local = os.environ.get("LOCAL_WORLD_SIZE")
        return int(local) if local else world_size

    def layout(self, world_size: int, num_experts: Optional[int] = None, *, node_split: bool = False) -> ParallelLayout:
        """The validated :class:`ParallelLayout` for ``world_size`` ranks (raises ``LayoutError``).
        ``node_split``: the layout splits EP by node (``moe.dispatcher=hierarchical``) with
        :meth:`resolved_nvlink_domain` ranks per node; otherwise the world counts as one node."""
        return ParallelLayout(
            world_size=world_size,
            tp=self.tp,
            cp=self.cp,
            pp=self.pp,
            vpp=self.vpp,
            last_stage_layers=self.last_stage_layers,
            first_stage_layers=self.first_stage_layers,
            pipeline_layout=self.pipeline_layout,
            ep=self.ep,
            etp=self.etp,
            order=self.order,
            num_experts=num_experts,
            nvlink_domain=self.resolved_nvlink_domain(world_size) if node_split else None,
        )


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """The loop (``train.*``); steps are 1-based: step k is reported after the k-th optimizer update."""

    steps: int = 60
    """Total optimizer steps; a resumed run continues up to this step."""
    global_batch_size: int = 16
    """Sequences per optimizer step over the whole job (the same in every layout)."""
    micro_batch_size: int = 2
    """Sequences per forward/backward on one data-parallel replica."""
    seq_length: int = 64
    """Tokens per sequence."""
    seed: int = 1234
    """Seed of the layout-independent weight initialization (the data order has ``data.seed``)."""
    precision: str = "fp32"
    """``fp32`` or ``bf16`` (bf16 parameters and compute, fp32 master weights and gradients)."""
    recompute: str = "none"
    """Activation recomputation mode (:mod:`folding.model.recompute`): ``none``, ``selective`` (the
    attention core, Megatron-Core's default ``core_attn``), ``moe`` (the MoE block) or ``full`` (the whole
    layer; only its input is kept)."""
    recompute_modules: List[str] = dataclasses.field(default_factory=list)
    """Megatron-Core's recompute modules, added to ``recompute``'s (``--recompute-granularity selective
    --recompute-modules``): ``core_attn``, ``layernorm`` (both norms' outputs), ``moe_act`` (the experts'
    activation output, from fc1's), ``mla_up_proj`` (MLA's up-projections and RoPE), ``mlp`` (dense MLPs),
    ``moe`` (the MoE block), ``shared_experts``; not with ``recompute=full`` (:mod:`folding.model.recompute`
    says what each keeps and runs again)."""
    offload_modules: List[str] = dataclasses.field(default_factory=list)
    """Megatron-Core's fine-grained activation offloading (``--fine-grained-activation-offloading
    --offload-modules``): what these modules keep for backward waits in host memory, copied out on a side
    stream as the forward passes and back one layer ahead in backward (:mod:`folding.memory.offload`):
    ``attn_norm``, ``qkv_linear``, ``core_attn``, ``attn_proj``, ``mlp_norm``, ``expert_fc1``, ``moe_act``.
    Same numbers bitwise; not with a recompute setting that already drops what a module would move."""
    compile: bool = False
    """``torch.compile`` each layer's dense part (input norm + attention sublayer,
    :mod:`folding.model.compile`, ``LayerSettings.compile_dense``); the MoE block stays eager. Off by
    default: turn it on where the benchmark shows it pays (compile time is paid once per process and shape)."""
    eval_interval: int = 20
    """Evaluate on the held-out split every this many steps (and after the last step); 0 disables."""
    eval_steps: int = 2
    """Global batches per evaluation."""
    dry_run: bool = False
    """Validate the layout for ``parallel.world_size`` (or the launched world), print parameter counts
    and the per-rank memory estimate, and exit without building the model or any process group."""
    collective_timeout_s: float = 600.0
    """A collective that does not finish in this many seconds fails the job with an error (the timeout of
    every process group). A rank whose peer (another rank, or the job's store) has given no heartbeat for
    half of it exits with one line naming the lost rank and its node, exit status 3
    (:mod:`folding.launch.watchdog`)."""
    threads: Optional[int] = None
    """CPU threads per process (``torch.set_num_threads``). null: ``OMP_NUM_THREADS`` when set (torchrun
    sets 1), else the CPUs this process may use (affinity and cgroup quota) divided by the processes on
    the node. The choice is printed at start."""

    def recompute_setting(self) -> str:
        """``recompute`` and ``recompute_modules`` as one setting string (the canonical name of their
        :class:`~folding.model.recompute.Recompute`; ``ValueError`` naming the key when invalid)."""
        return recompute_spec(self.recompute, self.recompute_modules).name

    def offload_setting(self) -> str:
        """``offload_modules`` as one setting string (names joined by commas, in the table's order)."""
        return ",".join(m for m in OFFLOAD_MODULES if m in self.offload_modules)


@dataclasses.dataclass(kw_only=True)
class WandbConfig:
    """Weights & Biases (``logging.wandb.*``); only rank 0 logs."""

    mode: str = "offline"
    """``offline`` (default: files under the run directory), ``online`` or ``disabled``."""
    project: str = "folding"
    """W&B project."""
    name: Optional[str] = None
    """Run name; null: the run directory's name."""


@dataclasses.dataclass(kw_only=True)
class LoggingConfig:
    """Metrics and console output (``logging.*``)."""

    metrics_file: str = "metrics.jsonl"
    """JSONL file (relative paths are inside the run directory); one ``kind: train`` record per step,
    appended and flushed every step, written by rank 0 only."""
    interval: int = 1
    """Console and W&B every this many steps (the JSONL gets every step regardless)."""
    console: bool = True
    """Print the progress bar and step lines on rank 0."""
    peak_tflops: Optional[float] = None
    """Peak dense TFLOP/s of one device for the MFU; null: looked up from the GPU name (none on CPU,
    where ``mfu`` is reported as null)."""
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    """W&B settings."""


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpointing (``checkpoint.*``); the engine that reads these keys is the checkpoint module."""

    dir: Optional[str] = None
    """Directory of this run's checkpoints; null: no saves."""
    save_interval: Optional[int] = None
    """Save every this many steps (and at the end); null: only at the end (when ``dir`` is set)."""
    load: Optional[str] = None
    """A checkpoint, or a directory of them (the latest complete one), to resume from. Must exist."""
    keep_last: Optional[int] = None
    """Keep only the newest N checkpoints; null keeps all."""
    async_save: bool = False
    """Write checkpoints in the background (DCP's asynchronous save): the step that saves only copies
    its state to host memory, training goes on while a background thread writes it, and the checkpoint
    is published (``COMPLETE``) once every rank's write has finished; the next save and the end of
    the run wait for it. Costs one host copy of this rank's model and optimizer state while in flight."""
    init_from_hf: Optional[str] = None
    """Start from these weights instead of a random initialization: a Hugging Face checkpoint
    directory (``config.json`` + safetensors) or a file of ``tools/convert_hf.py import``. Each rank
    reads only its slices; the optimizer starts fresh at step 0. The job's model must be the source's
    (checked before training starts). Ignored once ``dir`` holds a checkpoint to resume from; not
    combinable with ``load``."""
    init_from_megatron: Optional[str] = None
    """Start from the weights of a Megatron-Core ``torch_dist`` checkpoint instead of a random initialization:
    the directory Megatron-LM's ``--save`` wrote (its latest iteration) or one of its ``iter_<N>``
    directories, saved in any TP/PP/EP/ETP layout (:mod:`folding.checkpoint.from_megatron`). The job's model
    must be the checkpoint's: names and global shapes are checked before training starts; the routing
    (``moe.topk``, ``moe.pre_softmax``, ``moe.score_function``) and ``model.rope_theta`` are not in the
    checkpoint and must be set as Megatron had them. Each rank reads its slices; the optimizer starts fresh
    at step 0. Ignored once ``dir`` holds a checkpoint to resume from; not combinable with ``load`` or
    ``init_from_hf``."""


@dataclasses.dataclass(kw_only=True)
class JobConfig:
    """The whole training job, typed and validated (see the module docstring)."""

    model: ModelConfig
    """Architecture: a preset with the ``model.*`` overrides and, in ``model.moe``, the preset's MoE
    options with the ``moe.*`` overrides."""
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """Folded layout sizes."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Loop settings."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Datasets."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Checkpointing."""
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    """Metrics and logging."""
    notes: typing.Tuple[str, ...] = ()
    """What the loader chose for settings left null (printed when the run starts)."""

    @property
    def moe(self) -> MoEConfig:
        """The MoE options: ``model.moe`` (the one record; the Hydra section ``moe`` sets it)."""
        return self.model.moe

    def layout(self, world_size: int) -> ParallelLayout:
        """The validated folded layout of this job on ``world_size`` ranks."""
        return self.parallel.layout(
            world_size, self.model.moe.num_experts, node_split=self.model.moe.dispatcher == "hierarchical"
        )

    def to_dict(self) -> Dict[str, Any]:
        """Plain nested dict of every resolved setting, shaped like the Hydra tree (``model`` without
        its MoE record, which is the ``moe`` section): ``job_config_from_dict(job.to_dict())`` rebuilds
        the same job."""
        out = dataclasses.asdict(self)
        out["moe"] = out["model"].pop("moe")
        return {k: out[k] for k in ("model", "moe", *[k for k in out if k not in ("model", "moe")])}


def _build(cls, section: str, values: Optional[Mapping[str, Any]]):
    values = dict(values or {})
    names = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in names:
            _fail(f"{section}.{key}", values[key], "unknown key", f"use one of {', '.join(sorted(names))}")
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        msg = str(e)
        raise ConfigError(msg if f"{section}." in msg else f"{section}: {msg}") from None


def job_config_from_dict(tree: Mapping[str, Any]) -> JobConfig:
    """Build and validate a :class:`JobConfig` from a plain nested dict (Hydra's composed config after
    ``OmegaConf.to_container(resolve=True)``, or a dict written by hand). ``hydra`` keys are ignored."""
    tree = {k: v for k, v in tree.items() if k != "hydra"}
    known = {f.name for f in dataclasses.fields(JobConfig)} | {"moe"}
    for key in tree:
        if key not in known:
            _fail(key, tree[key], "unknown section", f"use one of {', '.join(sorted(known))}")
    if not tree.get("model"):
        raise ConfigError("model is missing; choose a preset with model=<name> (e.g. model=mixtral_tiny)")
    model_values = dict(tree["model"])
    if "moe" in model_values:
        _fail("model.moe", "...", "the MoE options are their own section", "set them as moe.<key>")
    if "mlp_only_layers" in model_values and model_values["mlp_only_layers"] is not None:
        model_values["mlp_only_layers"] = tuple(model_values["mlp_only_layers"])
    model_values["moe"] = _build(MoEConfig, "moe", tree.get("moe"))
    for key, record in (("mla", MLAConfig), ("yarn", YarnConfig)):  # nested records (DeepSeek-V3)
        if isinstance(model_values.get(key), Mapping):
            model_values[key] = _build(record, f"model.{key}", model_values[key])
    model = _build(ModelConfig, "model", model_values)
    optim_values = dict(tree.get("optim") or {})
    notes = [str(n) for n in tree.get("notes") or ()]  # what a loader before this one chose (model=from_hf)
    notes += resolve_learning_rate(optim_values, init_from_hf=(tree.get("checkpoint") or {}).get("init_from_hf"))
    if optim_values.get("warmup_steps", DEFAULT_WARMUP_STEPS) is None:
        train_steps = (tree.get("train") or {}).get("steps", TrainConfig.steps)
        horizon = optim_values.get("decay_steps") or train_steps
        warmup = default_warmup_steps(horizon)
        optim_values["warmup_steps"] = warmup
        if warmup != DEFAULT_WARMUP_STEPS:
            notes.append(
                f"optim.warmup_steps: {warmup} (the default {DEFAULT_WARMUP_STEPS}, at most half of "
                f"the {horizon}-step schedule)"
            )
    logging_values = dict(tree.get("logging") or {})
    logging_values["wandb"] = _build(WandbConfig, "logging.wandb", logging_values.get("wandb"))
    job = JobConfig(
        model=model,
        parallel=_build(ParallelConfig, "parallel", tree.get("parallel")),
        train=_build(TrainConfig, "train", tree.get("train")),
        optim=_build(OptimConfig, "optim", optim_values),
        data=_build(DataConfig, "data", tree.get("data")),
        checkpoint=_build(CheckpointConfig, "checkpoint", tree.get("checkpoint")),
        logging=_build(LoggingConfig, "logging", logging_values),
        notes=tuple(notes),
    )
    return job


def env_world_size() -> int:
    """torchrun's ``WORLD_SIZE``, or 1 when launched with plain python."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment WORLD_SIZE={value!r} is not an integer; launch with torchrun") from None


def plain_tree(x):
    """``x`` with tuples turned into lists, recursively (for YAML / JSON dumps of configs)."""
    if isinstance(x, dict):
        return {k: plain_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain_tree(v) for v in x]
    return x
