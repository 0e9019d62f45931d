"""The training entry point's command line, checked before Hydra starts.

``examples/pretrain_mixtral.py`` calls :func:`check_command_line` first. It composes the config the
way Hydra will (same ``configs/``, same overrides), builds the typed job and validates it for the
launched world, checks that ``parallel.gpu`` names a GPU kind the planner knows, and checks that this
machine runs the experts' backend and FP8 recipe (:func:`folding.job.machine.check_experts_here`). So a
typo, a bad value, an impossible layout or a backend this machine lacks (and a job whose predicted memory
does not fit the GPU: in a dry run the GPU of ``parallel.gpu`` or else this machine's, in a run the GPU that
``parallel.gpu`` names; :mod:`folding.launch.device_memory`)

- is reported as one ``error: ...`` line, printed once per node (by the process with local rank 0;
  the other processes find the same error and wait for torchrun to stop them: :func:`report_error`),
  with no traceback, exit status 2;
- leaves no run directory behind (Hydra creates it only when it runs the job);

and ``train.dry_run=true`` prints its report and exits 0 the same way. A key that is not in the
schema is named with its closest valid spelling (``train.stpes``: did you mean ``train.steps``?).

Multirun sweeps (``-m``) and Hydra's own flags (``--help``, ``--cfg``, ...) are left to Hydra;
:func:`folding.launch.run.run_job` checks each job of a sweep again.

:func:`normalize_overrides` lets ``data.split=80,20,0`` through as a list (Hydra would otherwise read
the commas as a sweep and ask for quotes).

Usage::

    register_schema()
    status = check_command_line(sys.argv[1:], config_dir=CONFIGS, config_name="config")
    if status is not None:
        sys.exit(status)
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import sys
import time
import typing
from typing import List, Optional, Sequence, Tuple

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from ..interop.megatron.args import MegatronArgsError, convert
from ..interop.megatron.flags import leaf_synonyms
from ..job.compose import compose_tree
from ..job.config import ConfigError, env_world_size, job_config_from_dict
from ..job.machine import check_experts_here
from ..job.schema import job_schema
from ..job.validate import validate_job
from ..planning.job_memory import stage_memories
from .device_memory import check_memory_fits, named_gpu
from .dry_run import dry_run_report
from .model_from_hf import resolve_from_hf

CONFIG_GROUPS = ("model", "recipes")
"""Config groups chosen on the command line as ``group=name``."""

LIST_KEYS = ("data.split",)
"""Keys whose comma-separated command-line value is a list, not a sweep."""


def lead_process() -> bool:
    """Whether this process prints for its node: local rank 0 (torchrun's ``LOCAL_RANK``; plain
    python is its own lead)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


ERROR_GRACE_S = 30.0
"""How long a process other than the node's lead waits, after finding an error, for the lead to
report it and end the job (see :func:`report_error`)."""


def report_error(message: str, stream=None, grace_s: Optional[float] = None) -> None:
    """Print ``error: <message>`` as one line, once per node.

    The lead process prints at once. Every other process finds the same error (the checks are
    deterministic), but must not exit first: torchrun stops all workers as soon as one fails, and a
    lead stopped before it printed would leave no message at all. So another process waits up to
    ``grace_s`` (default :data:`ERROR_GRACE_S`) for torchrun to end it after the lead's exit; if it
    is still running then (an error of this process alone, or a launcher that does not stop the
    others), it prints the error itself, naming its rank, and returns.
    """
    one_line = "; ".join(part.strip() for part in str(message).splitlines() if part.strip())
    if lead_process():
        print(f"error: {one_line}", file=stream or sys.stderr, flush=True)
        return
    time.sleep(ERROR_GRACE_S if grace_s is None else grace_s)
    print(f"error (rank {os.environ.get('RANK', '?')}): {one_line}", file=stream or sys.stderr, flush=True)


def normalize_overrides(args: Sequence[str]) -> List[str]:
    """``args`` with ``data.split=80,20,0`` rewritten to ``data.split=[80,20,0]`` (a list value rather
    than a Hydra sweep); every other argument unchanged."""
    out = []
    for arg in args:
        key, eq, value = arg.partition("=")
        if eq and key in LIST_KEYS and "," in value and not value.startswith(("[", "'", '"')):
            arg = f"{key}=[{value}]"
        out.append(arg)
    return out


def schema_keys() -> List[str]:
    """Every dotted key of the job schema (``train.steps``, ``moe.topk``, ``logging.wandb.mode``, ...)."""

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            if dataclasses.is_dataclass(t):
                yield from walk(t, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}"

    return list(walk(job_schema(), ""))


MOVED_KEYS = {
    "model.moe_ffn_hidden_size": "moe.ffn_hidden_size",
    "model.router_aux_loss_coef": "moe.aux_loss_coeff",
    "model.norm_topk_prob": "moe.pre_softmax (its negation)",
}
"""Model keys whose option is now a field of the MoE record under another name."""


def synonyms(key: str, keys) -> List[str]:
    """The valid keys that ``key`` names under another spelling: a known synonym of its last part
    (``learning_rate`` -> ``optim.lr``, ``num_expert`` -> ``moe.num_experts``, Megatron-LM's argument
    names such as ``tensor_model_parallel_size`` -> ``parallel.tp``:
    :func:`folding.interop.megatron.flags.leaf_synonyms`), else the same last part in another section
    (``train.lr`` -> ``optim.lr``; at most two)."""
    leaf = key.split(".")[-1]
    target = leaf_synonyms().get(leaf)
    if target in keys and target != key:
        return [target]
    same_leaf = [k for k in sorted(keys) if k.split(".")[-1] == leaf and k != key]
    return same_leaf if 0 < len(same_leaf) <= 2 else []


def unquoted_layout(args: Sequence[str]) -> Optional[str]:
    """The error message for a ``parallel.pipeline_layout`` override whose value is not quoted for Hydra
    (its ``|``, ``(``, ``)`` and ``*`` are Hydra's own syntax), or ``None``."""
    for arg in args:
        key, _, value = arg.partition("=")
        if key.lstrip("+") == "parallel.pipeline_layout" and value[:1] not in ("'", '"') and set(value) & set("|()*"):
            return (
                f"parallel.pipeline_layout={value}: Hydra reads |, (, ) and * in an override as its own syntax; "
                "quote the value for Hydra (and the whole override for the shell): "
                f"\"parallel.pipeline_layout='{value}'\""
            )
    return None


def unknown_key(args: Sequence[str]) -> Optional[str]:
    """The error message for the first override whose key the schema does not have (with the closest
    valid keys), or ``None``. Hydra keys, config groups and ``+``/``~`` edits are not checked."""
    keys = None
    for arg in args:
        key, eq, _ = arg.partition("=")
        if not eq or key.startswith(("hydra", "+", "~", "-")) or "/" in key or key in CONFIG_GROUPS:
            continue
        keys = keys if keys is not None else set(schema_keys())
        if key in keys:
            continue
        section = key.split(".")[0]
        moved = MOVED_KEYS.get(key) or (
            f"moe.{key[6:]}" if key.startswith("model.") and f"moe.{key[6:]}" in keys else None
        )
        close = (
            [moved] if moved else synonyms(key, keys) or difflib.get_close_matches(key, sorted(keys), n=2, cutoff=0.8)
        )
        hint = (
            f"did you mean {' or '.join(close)}?"
            if close
            else f"valid keys under {section}: {', '.join(sorted(k for k in keys if k.startswith(section + '.')))}"
            if any(k.startswith(section + ".") for k in keys)
            else f"sections: {', '.join(sorted({k.split('.')[0] for k in keys}))}"
        )
        return f"{key}: unknown key; {hint}"
    return None


HYDRA_FLAGS = (
    "--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--resolve", "--package", "-p", "--run", "-r",
    "--multirun", "-m", "--shell-completion", "-sc", "--config-path", "-cp", "--config-name", "-cn",
    "--config-dir", "-cd", "--experimental-rerun", "--info", "-i",
)  # fmt: skip
"""Hydra's own command-line flags (everything else on the command line is an override)."""


def foreign_flags(args: Sequence[str]) -> Optional[str]:
    """The error for ``--flags`` that are not Hydra's (Megatron-LM habits such as
    ``--tensor-model-parallel-size 2``), or ``None``. When they convert
    (:func:`folding.interop.megatron.args.convert`), the message gives the overrides that say the same."""
    flags = [a for a in args if a.startswith("--") and a.split("=")[0] not in HYDRA_FLAGS]
    if not flags:
        return None
    start = args.index(flags[0])
    megatron = [a for a in args[start:] if a.startswith("--") or "=" not in a]
    unique = list(dict.fromkeys(a.split("=")[0] for a in flags))
    names, one = " ".join(unique), len(unique) == 1
    try:
        overrides = " ".join(convert(megatron).overrides)
    except MegatronArgsError as e:
        return (
            f"{names}: {'not a flag' if one else 'not flags'} of this entry point, which takes Hydra overrides "
            "(key=value, e.g. parallel.tp=2); "
            f"as Megatron-LM flags: {e}; python -m tools.megatron_args converts a Megatron-LM command line "
            "(docs/megatron.md has the table)"
        )
    return (
        f"{names}: {'a Megatron-LM flag' if one else 'Megatron-LM flags'}; this entry point takes Hydra "
        f"overrides, here: {overrides} "
        "(python -m tools.megatron_args converts a whole Megatron-LM command line; docs/megatron.md has the table)"
    )


def check_command_line(
    args: Sequence[str], *, config_dir: str, config_name: str = "config", world_size: Optional[int] = None
) -> Optional[int]:
    """Check the job that ``args`` (the overrides, without the program name) describes.

    Returns the exit status to stop with (2 after printing the error; 0 after printing a dry run's
    report) or ``None`` when the job is valid and Hydra should run it. No file is written.
    """
    return check_and_compose(args, config_dir=config_dir, config_name=config_name, world_size=world_size)[0]


def check_and_compose(
    args: Sequence[str], *, config_dir: str, config_name: str = "config", world_size: Optional[int] = None
) -> Tuple[Optional[int], Optional[dict]]:
    """:func:`check_command_line`'s status, and the job's config it composed (a plain dict, what Hydra's run
    hands the job) when the job is valid; ``None`` for the config when Hydra has to compose it (a sweep or
    a Hydra flag: nothing was checked) or the job stops here."""
    foreign = foreign_flags(args)
    if foreign:
        report_error(foreign)
        return 2, None
    if any(a.startswith("-") for a in args):  # multirun or a Hydra flag: Hydra handles it
        return None, None
    try:
        message = unquoted_layout(args) or unknown_key(args)
        if message:
            raise ConfigError(message)
        tree = compose_tree(args, config_dir=config_dir, config_name=config_name)
        job = job_config_from_dict(resolve_from_hf(copy.deepcopy(tree)))  # the tree goes back untouched
        world = env_world_size() if world_size is None else world_size
        if job.train.dry_run:
            report = dry_run_report(job, world_size=job.parallel.world_size or world)
            if lead_process() and os.environ.get("RANK", "0") == "0":
                print(report, flush=True)
            return 0, None
        layout = validate_job(job, world_size=world)
        gpu = named_gpu(job)  # a GPU kind named: the job must fit it, as its dry run says
        if gpu is not None:
            check_memory_fits(job, layout, gpu, f"parallel.gpu={job.parallel.gpu}", stage_memories(job, layout))
        check_experts_here(job)  # this machine runs moe.expert_backend with moe.fp8_recipe
    except (HydraException, OmegaConfBaseException) as e:
        report_error(_hydra_message(e))
        return 2, None
    except (ConfigError, ValueError) as e:
        report_error(str(e))
        return 2, None
    return None, tree


def _hydra_message(e: BaseException) -> str:
    """Hydra's and OmegaConf's message as one line: without their object-type, full-key and search-path
    trailers, the override named first, a list of options joined by commas."""
    lines = []
    for exc in (e, e.__cause__):
        for line in str(exc or "").splitlines():
            line = line.strip()
            if line.startswith(("Config search path", "provider=")):
                break
            if line and not line.startswith(("object_type=", "full_key:", "reference_type=")) and line not in lines:
                lines.append(line)
    out, prefix, listing, override = [], "", False, ""
    for line in lines:
        if line.startswith("Error merging override "):
            override = line[len("Error merging override ") :]
            prefix = override + ": "
        elif listing:
            out[-1] += (" " if out[-1].endswith(":") else ", ") + line
        else:
            out.append(prefix + line)
            prefix, listing = "", line.startswith("Available options") and line.endswith(":")
    key, eq, value = override.partition("=")
    if eq and any("is not a ListConfig" in line for line in lines):  # a bare value where a list is expected
        out.append(f"{key} takes a list: write {key}=[{value}]")
    return "; ".join(part.rstrip(".") if i < len(out) - 1 else part for i, part in enumerate(out))
