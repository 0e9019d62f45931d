"""The Hydra structured-config schema of a job, derived from the typed dataclasses.

Hydra checks every override against this schema while composing (an unknown key or a value of the
wrong type fails with Hydra's own message naming the key). The schema mirrors the typed sections
field by field (same names, types and defaults) but without their validation or frozenness, so that
Hydra can merge overrides into it; the typed objects are built afterwards by
:func:`folding.job.config.job_config_from_dict`, which validates.

Usage::

    register_schema()          # before @hydra.main or Hydra's compose API
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Dict, List, Optional, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from ..data.config import DataConfig
from ..model.config import ModelConfig
from ..model.mla_config import MLAConfig
from ..model.presets import get_preset, list_presets
from ..model.yarn_config import YarnConfig
from ..moe.config import MoEConfig
from ..optim.config import OptimConfig
from . import config as C


def _default_of(f: dataclasses.Field) -> dataclasses.Field:
    if f.default is not dataclasses.MISSING:
        return dataclasses.field(default=f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return dataclasses.field(default_factory=f.default_factory)  # type: ignore[misc]
    return dataclasses.field(default=MISSING)


def _omegaconf_type(t):
    """``t`` with ``Literal[...]`` enumerations turned into their value type (OmegaConf has no
    ``Literal``; the typed config checks the value when it is built)."""
    if typing.get_origin(t) is typing.Literal:
        return type(typing.get_args(t)[0])
    if typing.get_origin(t) is typing.Union:
        return Optional[_omegaconf_type(next(a for a in typing.get_args(t) if a is not type(None)))]
    return t


def mirror(
    cls, *, overrides: Tuple[Tuple[str, Any, dataclasses.Field], ...] = (), without: Tuple[str, ...] = ()
) -> type:
    """A plain (mutable, unvalidated) dataclass with ``cls``'s fields, types and defaults;
    ``overrides`` replace some fields by ``(name, type, field)``; fields in ``without`` are left out."""
    hints = typing.get_type_hints(cls)
    replaced = {name: (name, t, f) for name, t, f in overrides}
    fields: List[tuple] = []
    for f in dataclasses.fields(cls):
        if f.name not in without:
            fields.append(replaced.get(f.name, (f.name, _omegaconf_type(hints[f.name]), _default_of(f))))
    out = dataclasses.make_dataclass(cls.__name__ + "Schema", fields, kw_only=True)
    out.__doc__ = f"Hydra schema mirroring {cls.__module__}.{cls.__name__} (see its field docs)."
    return out


def job_schema() -> type:
    """The schema class of the whole job tree (``model, moe, parallel, train, optim, data,
    checkpoint, logging``)."""
    section = lambda name, cls: (name, cls, dataclasses.field(default_factory=cls))  # noqa: E731
    nested = lambda name, cls: (name, Optional[mirror(cls)], dataclasses.field(default=None))  # noqa: E731
    model = mirror(ModelConfig, without=("moe",), overrides=(nested("mla", MLAConfig), nested("yarn", YarnConfig)))
    logging = mirror(C.LoggingConfig, overrides=(section("wandb", mirror(C.WandbConfig)),))
    return dataclasses.make_dataclass(
        "JobSchema",
        [
            ("model", model, dataclasses.field(default=MISSING)),
            section("moe", mirror(MoEConfig)),
            section("parallel", mirror(C.ParallelConfig)),
            section("train", mirror(C.TrainConfig)),
            section(
                "optim",
                mirror(
                    OptimConfig,
                    overrides=tuple(
                        (name, Optional[t], dataclasses.field(default=None))
                        for name, t in (("warmup_steps", int), ("lr", float), ("min_lr", float))
                    ),
                ),
            ),
            section(
                "data", mirror(DataConfig, overrides=(("split", Any, dataclasses.field(default=DataConfig.split)),))
            ),
            section("checkpoint", mirror(C.CheckpointConfig)),
            section("logging", logging),
        ],
        kw_only=True,
    )


def preset_node(name: str) -> Dict[str, Any]:
    """The Hydra node of model preset ``name``: ``{"model": <its fields>, "moe": <its MoE record>}``,
    merged at the root of the job tree (so ``model.<field>`` and ``moe.<field>`` override it)."""
    tree = C.plain_tree(dataclasses.asdict(get_preset(name)))
    return {"moe": tree.pop("moe"), "model": tree}


FROM_HF = "from_hf"
"""The ``model`` option that takes the architecture from ``checkpoint.init_from_hf``'s ``config.json``."""
FROM_HF_PLACEHOLDER = "mixtral_tiny"
"""The preset whose values stand in the ``from_hf`` node: a ``model.*`` / ``moe.*`` value that differs
from them is one the command line set (:func:`folding.launch.model_from_hf.resolve_from_hf`)."""


def from_hf_node() -> Dict[str, Any]:
    """The Hydra node of ``model=from_hf``: the placeholder preset's fields, named ``from_hf``."""
    node = preset_node(FROM_HF_PLACEHOLDER)
    node["model"]["name"] = FROM_HF
    return node


def register_schema() -> None:
    """Register, in Hydra's ConfigStore, the structured-config schema ``job_schema`` (listed first in
    ``configs/config.yaml``'s defaults) and every preset of :mod:`folding.model.presets` as an option
    of the config group ``model`` (``model=mixtral_tiny``; a recipe's ``override /model: ...``), and
    ``model=from_hf`` (:func:`from_hf_node`). The presets are defined once, in Python; there is no YAML
    copy of them."""
    store = ConfigStore.instance()
    store.store(name="job_schema", node=job_schema())
    for name in list_presets():
        store.store(group="model", name=name, node=preset_node(name), package="_global_")
    store.store(group="model", name=FROM_HF, node=from_hf_node(), package="_global_")
