"""Pretrain a Mixtral-style (or Qwen2-MoE) model with MoE Parallel Folding.

    torchrun --nproc-per-node 4 examples/pretrain_mixtral.py parallel.tp=2 parallel.ep=4 parallel.etp=1
    python examples/pretrain_mixtral.py model=qwen2_moe_tiny train.steps=20            # 1 process
    python examples/pretrain_mixtral.py recipes=mixtral_8x22b train.dry_run=true       # check a recipe
    torchrun --nproc-per-node 4 examples/pretrain_mixtral.py -m parallel.ep=1,2,4 parallel.etp=1

Configuration: configs/ (Hydra), typed and validated by folding.training.config; see docs/training.md.
"""
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from folding.training.config import register_schema
from folding.training.launch import quiet_hydra_argv, run_job

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs")


@hydra.main(config_path=CONFIGS, config_name="config", version_base="1.3")
def main(cfg) -> None:
    status = run_job(OmegaConf.to_container(cfg, resolve=True), run_dir=HydraConfig.get().runtime.output_dir)
    if status:
        sys.exit(status)


if __name__ == "__main__":
    register_schema()
    sys.argv = quiet_hydra_argv(sys.argv)
    main()
