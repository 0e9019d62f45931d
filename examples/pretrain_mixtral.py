"""Pretrain a Mixtral-style (or Qwen2-MoE, Qwen3-MoE, OLMoE) model with MoE Parallel Folding.

    torchrun --nproc-per-node 4 examples/pretrain_mixtral.py parallel.tp=2 parallel.ep=4 parallel.etp=1
    python examples/pretrain_mixtral.py model=qwen2_moe_tiny train.steps=20            # 1 process
    python examples/pretrain_mixtral.py recipes=mixtral_8x22b train.dry_run=true       # check a recipe
    python examples/pretrain_mixtral.py model=qwen3_30b_a3b train.dry_run=true         # a preset's size
    torchrun --nproc-per-node 4 examples/pretrain_mixtral.py -m parallel.ep=1,2,4 parallel.etp=1

Configuration: configs/ (Hydra), typed and validated by folding.job.config; see docs/training.md.
The command line is checked before Hydra starts (folding.launch.cli): an error is one line, printed
once per node, exit status 2, and no run directory is created. Under torchrun only rank 0 goes through
Hydra's main (its run directory); the other ranks run the config the check composed.
"""

import contextlib
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from folding.job.schema import register_schema
from folding.launch.cli import check_and_compose, normalize_overrides
from folding.launch.run import env_rank, mode_from_command_line, quiet_hydra_argv, run_job, run_quiet_rank
from folding.launch.watchdog import exit_with_launcher
from folding.training.faults import interrupt_exits_quietly

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs")


@hydra.main(config_path=CONFIGS, config_name="config", version_base="1.3")
def main(cfg) -> None:
    hc = HydraConfig.get()
    status = run_job(
        OmegaConf.to_container(cfg, resolve=True), run_dir=hc.runtime.output_dir, overrides=list(hc.overrides.task)
    )
    if status:
        sys.exit(status)


if __name__ == "__main__":
    exit_with_launcher()  # under torchrun: this worker ends with its torchrun, whatever it is doing
    with interrupt_exits_quietly():  # Ctrl-C before or after the job: one line, no traceback
        register_schema()
        sys.argv = [sys.argv[0]] + normalize_overrides(sys.argv[1:])
        status, tree = check_and_compose(sys.argv[1:], config_dir=CONFIGS, config_name="config")
        if status is not None:  # a bad setting (printed once) or a dry run: no run directory is made
            sys.exit(status)
        if tree is not None and env_rank() != 0:  # Hydra writes nothing here: run the config checked
            sys.exit(run_quiet_rank(tree, overrides=sys.argv[1:]))
        sys.argv = quiet_hydra_argv(sys.argv)
        with mode_from_command_line(sys.argv[1:]) if tree is not None else contextlib.nullcontext():
            main()
