"""From a composed config to a finished run: checks, process group, run directory, training.

:func:`run_job` is what ``examples/pretrain_mixtral.py`` calls with Hydra's composed config (as a
plain dict) and Hydra's output directory. Order matters:

1. build the typed config and check it (and open the data) -- no process group yet, so a bad config
   fails at once on every rank with a message naming the setting, printed once per node (exit status
   2); the entry point has usually caught it already (:mod:`folding.launch.cli`);
2. ``train.dry_run``: print the report and stop;
3. create the world process group from torchrun's environment (a 1-process world when launched with
   plain python; NCCL on GPU, gloo on CPU; ``train.collective_timeout_s``; a worker restarted by
   ``torchrun --max-restarts`` keys its rendezvous under its attempt number), and start the peer watch
   (heartbeats in the job's store: a lost rank ends the survivors within the timeout,
   :mod:`folding.launch.watchdog`);
4. rank 0's output directory (or, when resuming, the directory of the run that wrote the
   checkpoint) is broadcast so that every rank agrees; only rank 0 writes there (the resolved config,
   the metrics, ``train.log``, ``status.json``: :mod:`folding.launch.run_dir`);
5. pick the CPU thread count (:mod:`folding.launch.threads`), train, then destroy the process group
   (so that Hydra multirun can start the next job).

Usage::

    sys.argv = quiet_hydra_argv(sys.argv)        # before @hydra.main: ranks > 0 write nothing
    status = run_job(OmegaConf.to_container(cfg, resolve=True), run_dir=HydraConfig.get().runtime.output_dir)
"""

from __future__ import annotations

import contextlib
import datetime
import logging.config
import os
import socket
import tempfile
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ..checkpoint.load import step_dir_name
from ..job.config import ConfigError, env_world_size, job_config_from_dict
from ..job.config import plain_tree as _plain
from ..job.machine import experts_summary
from ..model.recompute import RECOMPUTE_MODULES, recompute_spec
from ..parallel.groups import release_process_groups
from ..training.faults import StopRequest
from ..training.trainer import prepare, train
from .cli import report_error
from .dry_run import dry_run_report
from .model_from_hf import resolve_from_hf
from .run_dir import RunLog, discard_if_empty, write_status
from .threads import configure_threads
from .watchdog import LOST_PEER_EXIT, PeerWatch, collective_failure, exit_with_launcher, report_lost


def env_rank() -> int:
    """torchrun's ``RANK`` (0 when launched with plain python)."""
    return int(os.environ.get("RANK", "0"))


def quiet_hydra_argv(argv: List[str]) -> List[str]:
    """``argv`` plus, on ranks other than 0, overrides that keep Hydra from creating or writing any
    directory: its run directory becomes the working directory (which exists), with no ``.hydra``
    subdirectory and no log files. Only rank 0 has a run directory."""
    if env_rank() == 0:
        return argv
    quiet = [
        "hydra.run.dir=.",
        "hydra.output_subdir=null",
        "hydra/job_logging=disabled",
        "hydra/hydra_logging=disabled",
    ]
    if "-m" in argv or "--multirun" in argv:  # a sweep writes multirun.yaml into its sweep directory
        scratch = os.path.join(tempfile.gettempdir(), f"folding-hydra-sweep-{os.getuid()}")
        quiet += [f"hydra.sweep.dir={scratch}", "hydra.sweep.subdir=."]
    return argv + quiet


def run_quiet_rank(tree: Dict[str, Any], overrides: List[str]) -> int:
    """Run the job on a rank other than 0 from the config the entry point's checks composed
    (:func:`folding.launch.cli.check_and_compose`), without Hydra's main: what Hydra's run does on such a
    rank under :func:`quiet_hydra_argv` (the working directory as run directory, nothing written, logging
    as Hydra's ``job_logging=disabled`` sets it) without composing the same config twice more (about a
    second of CPU per process before the first step, on every rank but one). ``overrides``: the command
    line's, as Hydra would pass them. Returns :func:`run_job`'s exit status."""
    logging.config.dictConfig({"version": 1, "root": {"level": "ERROR"}, "disable_existing_loggers": True})
    return run_job(tree, run_dir=os.getcwd(), overrides=overrides)


@contextlib.contextmanager
def mode_from_command_line(args: List[str]):
    """While Hydra's main runs the checked plain run of ``args`` (no ``-m``, no ``hydra.mode``): its look-up
    of the run mode answers without composing the whole config once more only to read ``hydra.mode``,
    which ``configs/`` leaves unset (Hydra's answer then is ``None``: a plain run). Saves one of rank 0's
    three compositions (:func:`folding.launch.cli.check_and_compose` made the first); anything else (a
    sweep, a Hydra flag, ``hydra.mode`` given) keeps Hydra's own look-up."""
    from hydra._internal.hydra import Hydra

    plain = not any(a.startswith("-") or a.lstrip("+~").startswith("hydra.mode") for a in args)
    original = Hydra.get_mode
    if plain:
        Hydra.get_mode = lambda self, config_name, overrides: None
    try:
        yield
    finally:
        Hydra.get_mode = original


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_INITS = [0]  # process groups this process has initialized (one per job of a Hydra multirun)


def _import_checkpointing_first(job) -> None:
    """Import ``torch.distributed.checkpoint`` before the world group exists, in a job that reads or writes
    checkpoints (``checkpoint.dir``, ``checkpoint.load``); a job that never does skips the import (about
    0.6 s of CPU per process; :mod:`folding.checkpoint.blocks`). Imported after the world group exists,
    DCP's import of ``torch.distributed.nn.functional`` binds that group as a default argument
    (``group=group.WORLD``, evaluated at import), which keeps the group object and its gloo threads alive
    after ``destroy_process_group``, into the interpreter's shutdown (:func:`release_process_groups`)."""
    if job.checkpoint.dir or job.checkpoint.load:
        import torch.distributed.checkpoint  # noqa: F401


def init_world(timeout_s: float) -> None:
    """Initialize the default process group from the environment (torchrun's, or a local 1-rank one)."""
    if "MASTER_ADDR" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    bind = {}
    if backend == "nccl":  # bound to its GPU: one communicator per group, created eagerly
        bind["device_id"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(bind["device_id"])
    timeout = datetime.timedelta(seconds=timeout_s)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    job = _INITS[0]
    _INITS[0] += 1
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if attempt == 0 and (job == 0 or not under_torchrun):
        dist.init_process_group(backend, timeout=timeout, **bind)
        return
    # A worker restarted by torchrun (--max-restarts), or the next job of a Hydra multirun in the same
    # workers, shares the rendezvous store with the earlier process group: keep this one's keys apart,
    # so that no rank reads a stale peer address.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = (
        dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=False,
            timeout=timeout,
            use_libuv=True,
        )
        if _agent_store()
        else dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=rank == 0, timeout=timeout
        )
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"attempt_{attempt}/job_{job}/", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
        **bind,
    )


def _agent_store() -> bool:
    """Whether torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT (its default)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def agree_on_run_dir(run_dir: str) -> str:
    """Collective over the world (broadcast from rank 0, no backward): rank 0's ``run_dir``."""
    box = [os.path.abspath(run_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def resolved_tree(job, layout) -> Dict[str, Any]:
    """``job.to_dict()`` with the settings the run resolves from null written as resolved: ``parallel.world_size``
    (the launched world), ``parallel.etp`` (follows ``parallel.tp``), ``parallel.nvlink_domain`` (the ranks per
    node the dispatchers use: ``LOCAL_WORLD_SIZE``, else the world) and ``train.recompute_modules`` (the
    modules recomputed on their own, ``train.recompute``'s with those given). A job built from it
    (``job_config_from_dict``) runs the same layout and computes the same."""
    tree = job.to_dict()
    par = tree["parallel"]
    par["world_size"] = layout.world_size
    par["etp"] = layout.etp
    par["nvlink_domain"] = job.parallel.resolved_nvlink_domain(layout.world_size)
    spec = recompute_spec(job.train.recompute, job.train.recompute_modules)
    tree["train"]["recompute_modules"] = [m for m in RECOMPUTE_MODULES if m in spec.modules]
    return tree


def decisions(job, layout) -> List[str]:
    """The start-up lines of what the engine chose for the user where the job leaves it open: the node size
    and the dispatcher's path, and the recomputed modules (the experts' backend and precision:
    :func:`~folding.job.machine.experts_summary`; values the loader chose: ``job.notes``)."""
    world = layout.world_size
    node = job.parallel.resolved_nvlink_domain(world)
    given = job.parallel.nvlink_domain
    why = (
        f"parallel.nvlink_domain={given}"
        if given is not None
        else ("LOCAL_WORLD_SIZE" if os.environ.get("LOCAL_WORLD_SIZE") else "the world: one node")
    )
    nodes = max(1, world // max(node, 1))
    if job.moe.dispatcher == "hierarchical":
        path = (
            f"moe.dispatcher=hierarchical: a token crosses to each other node once, over the rail group, then "
            f"spreads over its node ({nodes} nodes of {node} ranks)"
        )
    else:
        path = f"moe.dispatcher={job.moe.dispatcher}: one exchange over the EP group of {layout.ep} ranks"
    spec = recompute_spec(job.train.recompute, job.train.recompute_modules)
    what = (
        "the whole layer from its input"
        if spec.whole_layer
        else ", ".join(m for m in RECOMPUTE_MODULES if m in spec.modules)
    )
    return [
        f"nodes: {nodes} of {node} ranks ({why})",
        f"dispatch: {path}",
        f"recompute: {what or 'none'} (train.recompute={job.train.recompute}"
        + (f", train.recompute_modules={list(job.train.recompute_modules)})" if job.train.recompute_modules else ")"),
    ]


def save_resolved_config(job, run_dir: str, overrides: Optional[List[str]] = None, layout=None) -> str:
    """Write the resolved typed config as YAML into ``run_dir`` (a new file: never overwrites), headed
    by the command-line ``overrides`` as a comment; with ``layout`` (the run's), the settings resolved from
    null are written as resolved (:func:`resolved_tree`)."""
    import yaml

    os.makedirs(run_dir, exist_ok=True)
    base, n = os.path.join(run_dir, "resolved_config"), 0
    while True:
        path = f"{base}.yaml" if n == 0 else f"{base}.{n}.yaml"
        try:
            with open(path, "x", encoding="utf-8") as f:
                if overrides is not None:
                    f.write(f"# overrides: {' '.join(overrides)}\n")
                tree = job.to_dict() if layout is None else resolved_tree(job, layout)
                yaml.safe_dump(_plain(tree), f, sort_keys=False)
            return path
        except FileExistsError:
            n += 1


def choose_run_dir(run_dir: str, prepared) -> str:
    """Rank 0's run directory: the one that wrote the checkpoint being resumed, when it still exists
    (Hydra's fresh ``run_dir`` is then removed if empty), else ``run_dir``."""
    previous = getattr(prepared, "resume_run_dir", None)
    if previous and os.path.isdir(previous) and os.path.abspath(previous) != os.path.abspath(run_dir):
        discard_if_empty(run_dir)
        return os.path.abspath(previous)
    return run_dir


def run_job(tree: Dict[str, Any], *, run_dir: str, overrides: Optional[List[str]] = None) -> int:
    """Run the job described by the plain dict ``tree``; return the process exit status.

    0 after training (to the end, or stopped by SIGINT/SIGTERM with a checkpoint) and after a dry run;
    2 for a bad configuration or unreadable data, reported as one ``error:`` line by the node's lead
    process before any process group exists; 3 (:data:`~folding.launch.watchdog.LOST_PEER_EXIT`) when a
    collective failed because a peer rank or the job's store was lost, reported as one line naming it
    (:class:`~folding.launch.watchdog.PeerWatch`, which also ends a rank stuck in a collective with a lost
    peer, within ``train.collective_timeout_s``). Under torchrun the worker ends with its torchrun
    (:func:`~folding.launch.watchdog.exit_with_launcher`). In both early exits rank 0 removes ``run_dir`` if it is
    still empty. ``status.json`` in the run directory says how the run ended (see
    :mod:`folding.launch.run_dir`); ``overrides`` (the command line) head ``resolved_config.yaml``.
    SIGINT / SIGTERM stop the run at a step boundary from the moment this is called until it returns
    (:class:`~folding.training.faults.StopRequest`): one that comes while the job is being set up stops
    it after its first step; once a stop was requested, further signals are ignored.
    """
    stop = StopRequest()
    with stop.installed():
        return _run_job(tree, run_dir=run_dir, overrides=overrides, stop=stop)


def _run_job(tree: Dict[str, Any], *, run_dir: str, overrides: Optional[List[str]], stop: StopRequest) -> int:
    exit_with_launcher()  # under torchrun: this worker ends with its torchrun
    try:
        job = job_config_from_dict(resolve_from_hf(tree))
        world = env_world_size()
        if job.train.dry_run:
            if env_rank() == 0:
                print(dry_run_report(job, world_size=job.parallel.world_size or world), flush=True)
                discard_if_empty(run_dir)
            return 0
        prepared = prepare(job, world_size=world, rank=env_rank())
    except (ConfigError, ValueError, FileNotFoundError) as e:
        report_error(str(e))
        if env_rank() == 0:
            discard_if_empty(run_dir)
        return 2
    threads, why = configure_threads(job.train.threads)
    _import_checkpointing_first(job)
    init_world(job.train.collective_timeout_s)
    log, status, state, lost = None, "failed", {}, None
    seen: Dict[str, Any] = {}  # the run directory and log, for a lost peer's report from the watch thread
    watch = PeerWatch.start_for_world(
        timeout_s=job.train.collective_timeout_s, on_lost=lambda line: _record_lost(seen, line)
    )
    try:
        run_dir = agree_on_run_dir(choose_run_dir(run_dir, prepared) if dist.get_rank() == 0 else run_dir)
        if dist.get_rank() == 0:
            log = seen["log"] = RunLog(run_dir)
            seen["run_dir"] = run_dir
            log.capture_records()
            save_resolved_config(job, run_dir, overrides, layout=prepared.layout)
            write_status(run_dir, "running", step=None, checkpoint=None)
            log.echo(
                f"run directory: {run_dir}"
                + (" (resumed run: log and metrics appended)" if prepared.resume_run_dir == run_dir else "")
            )
            log.echo(f"layout: {prepared.layout.describe()}")
            log.echo(experts_summary(job, prepared.expert_backend))
            for line in decisions(job, prepared.layout):
                log.echo(line)
            if prepared.init_from_hf:
                log.echo(f"weights: {prepared.init_from_hf} (checkpoint.init_from_hf; fresh optimizer, step 0)")
            elif job.checkpoint.init_from_hf and prepared.resume:
                log.echo(f"checkpoint.init_from_hf ignored: resuming from {prepared.resume}")
            if prepared.init_from_megatron:
                log.echo(
                    f"weights: {prepared.init_from_megatron} (checkpoint.init_from_megatron; fresh optimizer, step 0)"
                )
            elif job.checkpoint.init_from_megatron and prepared.resume:
                log.echo(f"checkpoint.init_from_megatron ignored: resuming from {prepared.resume}")
            log.echo(f"threads: {threads} per process ({why})")
            for note in job.notes:
                log.echo(note)
        result = train(
            job, run_dir=run_dir, prepared=prepared, run_log=log, stop=stop
        )  # its groups' destroy() is the last barrier
        status = "stopped" if result["stopped"] else "completed"
        last = result["history"][-1]["step"] if result["history"] else None
        ck = result["last_checkpoint_step"]
        state = {
            "step": last,
            "checkpoint": os.path.join(os.path.abspath(job.checkpoint.dir), step_dir_name(ck))
            if ck is not None and job.checkpoint.dir
            else None,
        }
        result = None
    except Exception as e:
        # a collective that failed on a lost peer: wait for the watch to name it; anything else: no wait
        lost = watch.verdict(wait_s=None if collective_failure(e) else 0.0) if watch is not None else None
        if lost is None:
            raise
        report_lost(lost)
        if log is not None:
            log.echo(f"error: {lost}", console=False)
    finally:
        if log is not None:
            write_status(run_dir, status, **(state or {"step": None, "checkpoint": None}))
            log.close()
        if watch is not None:
            watch.close(done=status != "failed")
        release_process_groups()
    return LOST_PEER_EXIT if lost else 0


def _record_lost(seen: Dict[str, Any], line: str) -> None:
    """Rank 0's record of a lost peer found by the watch thread (the process exits right after):
    the line in ``train.log`` and ``status.json`` ``failed``."""
    if "log" in seen:
        seen["log"].echo(f"error: {line}", console=False)
        write_status(seen["run_dir"], "failed", step=None, checkpoint=None)
