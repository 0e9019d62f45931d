"""The Hydra structured-config schema of a job, derived from the typed dataclasses.

Hydra checks every override against this schema while composing (an unknown key or a value of the
wrong type fails with Hydra's own message naming the key). The schema mirrors the typed sections
field by field (same names, types and defaults) but without their validation or frozenness, so that
Hydra can merge overrides into it; the typed objects are built afterwards by
:func:`folding.training.config.job_config_from_dict`, which validates.

Usage::

    register_schema()          # before @hydra.main or Hydra's compose API
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, List, Optional, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from ..data.config import DataConfig
from ..model.config import ModelConfig
from ..optim.config import OptimConfig
from . import config as C


def _default_of(f: dataclasses.Field) -> dataclasses.Field:
    if f.default is not dataclasses.MISSING:
        return dataclasses.field(default=f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return dataclasses.field(default_factory=f.default_factory)  # type: ignore[misc]
    return dataclasses.field(default=MISSING)


def mirror(cls, *, overrides: Tuple[Tuple[str, Any, dataclasses.Field], ...] = ()) -> type:
    """A plain (mutable, unvalidated) dataclass with ``cls``'s fields, types and defaults;
    ``overrides`` replace some fields by ``(name, type, field)``."""
    hints = typing.get_type_hints(cls)
    replaced = {name: (name, t, f) for name, t, f in overrides}
    fields: List[tuple] = []
    for f in dataclasses.fields(cls):
        fields.append(replaced.get(f.name, (f.name, hints[f.name], _default_of(f))))
    out = dataclasses.make_dataclass(cls.__name__ + "Schema", fields, kw_only=True)
    out.__doc__ = f"Hydra schema mirroring {cls.__module__}.{cls.__name__} (see its field docs)."
    return out


def job_schema() -> type:
    """The schema class of the whole job tree (``model, moe, parallel, train, optim, data,
    checkpoint, logging``)."""
    section = lambda name, cls: (name, cls, dataclasses.field(default_factory=cls))  # noqa: E731
    model = mirror(ModelConfig)
    logging = mirror(C.LoggingConfig, overrides=(section("wandb", mirror(C.WandbConfig)),))
    return dataclasses.make_dataclass(
        "JobSchema",
        [
            ("model", model, dataclasses.field(default=MISSING)),
            section("moe", C.MoEOverrides),
            section("parallel", mirror(C.ParallelConfig)),
            section("train", mirror(C.TrainConfig)),
            section(
                "optim",
                mirror(OptimConfig, overrides=(("warmup_steps", Optional[int], dataclasses.field(default=None)),)),
            ),
            section(
                "data", mirror(DataConfig, overrides=(("split", Any, dataclasses.field(default=DataConfig.split)),))
            ),
            section("checkpoint", mirror(C.CheckpointConfig)),
            section("logging", logging),
        ],
        kw_only=True,
    )


def register_schema() -> None:
    """Register the Hydra structured-config schema ``job_schema`` in Hydra's ConfigStore;
    ``configs/config.yaml`` lists ``job_schema`` first in its defaults."""
    ConfigStore.instance().store(name="job_schema", node=job_schema())
