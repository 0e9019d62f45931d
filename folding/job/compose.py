"""Hydra's composition of the job's ``configs/`` as a plain dict, outside ``@hydra.main``.

The entry point's checks (:mod:`folding.launch.cli`) compose the config the way Hydra will before
Hydra starts, and :mod:`folding.interop.megatron.args` composes the defaults a converted job is
compared with. The structured schema must be registered first
(:func:`folding.job.schema.register_schema`).

Usage::

    register_schema()
    tree = compose_tree(["parallel.tp=2"], config_dir="configs", config_name="config")
"""

from __future__ import annotations

import os
from typing import Sequence

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf


def compose_tree(args: Sequence[str], *, config_dir: str, config_name: str) -> dict:
    """The composed config as a plain dict (Hydra's compose API, without the ``hydra`` node)."""
    overrides = [a for a in args if not a.startswith(("hydra.", "hydra/", "+hydra", "~hydra", "++hydra"))]
    with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)
