"""Start training from Hugging Face weights (``checkpoint.init_from_hf``), sharded on load.

``checkpoint.init_from_hf`` names either a Hugging Face checkpoint directory (``config.json`` with
``model.safetensors``, or safetensors shards with their index: what transformers' ``save_pretrained``
and ``tools/convert_hf.py export`` write) or the ``.pt`` file that ``tools/convert_hf.py import``
writes (the 1-rank engine state dict with its configs). A run with no checkpoint of its own to resume
from builds its model chunks without initializing them and fills every parameter with its slice of
the full tensor, as its record (:class:`~folding.parallel.params.ParamSpec`) says:

- from safetensors, each rank reads only the slices it holds, file by file
  (:func:`folding.model.hf.weights.load_hf_weights`: ``safe_open(...).get_slice``), through the same
  per-parameter mapping as ``from_hf`` and the export (:func:`folding.model.hf.names.hf_components`);
- from the ``.pt`` file, memory-mapped, so that a rank touches only the pages of its slices.

The optimizer starts fresh and the run starts at step 0. Once the run has saved checkpoints of its
own, a restart resumes from them and ``init_from_hf`` is ignored (the trainer says so);
``checkpoint.load`` together with ``init_from_hf`` is refused by the validation.

Before any process group exists, :func:`check_init_source` compares the job's model with the
source's: every ``model.*`` field but those that change no computation (:data:`FREE_MODEL_FIELDS`)
and the MoE options that shape tensors or define the routing (:data:`MOE_FIELDS`); a difference
fails with an error naming each key and the overrides that fix it. Training options (aux and z
losses, capacity, dispatcher, precision, ...) are free. Then the tensor names of the source are
checked against the config (the safetensors headers or the index only).

Usage::

    path = check_init_source(job.checkpoint.init_from_hf, job.model)   # in prepare(): no collective
    load_initial_weights(chunks, path)                                 # every rank, its own slices
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional

import torch

from ..job.config import ConfigError
from ..model.config import ModelConfig
from ..model.hf.errors import CheckpointError
from ..model.hf.weights import VOCAB_TABLES, check_hf_names, hf_model_config, load_hf_weights
from ..parallel.params import require_spec, take_slice
from .load import SHAPED_MOE_FIELDS, config_differences

FREE_MODEL_FIELDS = (
    "name",
    "init_std",
    "mtp_loss_scaling_factor",
    "hidden_dropout",
    "attention_dropout",
    "make_vocab_size_divisible_by",
)
"""``model.*`` fields that may differ from the source: they change no weight and no computation (the
padded vocabulary rows of ``make_vocab_size_divisible_by`` start at zero and are never predicted).
``max_position_embeddings`` is checked although it changes neither: the export of the run writes it
into ``config.json``, where another value would misstate what the source model was trained for."""
MOE_FIELDS = SHAPED_MOE_FIELDS + (
    "topk",
    "score_function",
    "pre_softmax",
    "num_groups",
    "group_topk",
    "group_score_topk",
    "topk_scaling_factor",
)
"""``moe.*`` fields that must equal the source's: those that shape tensors and those that say how the
router turns its weights into a routing (every other MoE option is a training choice)."""


def _is_engine_file(path: str) -> bool:
    return os.path.isfile(path)


def _engine_file(path: str) -> Dict[str, Any]:
    """The ``tools/convert_hf.py import`` file, memory-mapped (no tensor is read until sliced)."""
    try:
        blob = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as e:  # a foreign or damaged file: say which setting points at it
        raise ConfigError(
            f"checkpoint.init_from_hf={path!r} is not a Hugging Face directory and not a file written "
            f"by tools/convert_hf.py import ({type(e).__name__}: {e}); point it at one of them"
        ) from None
    if not isinstance(blob, dict) or not {"model_config", "state_dict"} <= set(blob):
        raise ConfigError(
            f"checkpoint.init_from_hf={path!r} holds no model_config/state_dict: give a Hugging Face "
            "directory or a file written by tools/convert_hf.py import"
        )
    return blob


def source_model_config(path: str) -> ModelConfig:
    """The :class:`ModelConfig` of the weights at ``path`` (a Hugging Face directory or an import file)."""
    if _is_engine_file(path):
        return ModelConfig.from_dict(_engine_file(path)["model_config"])
    try:
        return hf_model_config(path)
    except CheckpointError as e:
        raise ConfigError(f"checkpoint.init_from_hf={path!r}: {e}") from None


def read_hf_source_config(path: str) -> Optional[Dict[str, Any]]:
    """The ``config.json`` of the Hugging Face directory ``path`` as a dict; ``None`` for an import file
    (its own model config is all it holds)."""
    if _is_engine_file(path):
        return None
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def _override(key: str, value: Any) -> str:
    """``key=value`` as a Hydra override (lists bracketed, None as null, booleans lower case)."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, (list, tuple)):
        text = "[" + ",".join(str(v) for v in value) + "]"
    else:
        text = str(value)
    return f"{key}={text}"


def check_init_source(path: str, model: ModelConfig) -> str:
    """Check that the weights at ``path`` fit the job's ``model`` (config, then tensor names, reading
    no tensor); return the absolute path. Raises :class:`ConfigError` naming every mismatching key,
    with the overrides that make the job's model the source's. No process group is needed."""
    path = os.path.abspath(os.path.expanduser(path))
    source = source_model_config(path)
    diff: List = config_differences(
        dataclasses.asdict(source), model, free_model_fields=FREE_MODEL_FIELDS, moe_fields=MOE_FIELDS
    )
    if diff:
        raise ConfigError(
            f"checkpoint.init_from_hf={path!r} holds another model than this job's: "
            + "; ".join(f"{k}: source {a!r}, this job {b!r}" for k, a, b in diff)
            + ". Set "
            + " ".join(_override(k, a) for k, a, _ in diff)
            + " (the source's values), or point checkpoint.init_from_hf at weights of this model"
        )
    if not _is_engine_file(path):  # an import file holds the parameters of its own model_config
        try:
            check_hf_names(path, model)
        except CheckpointError as e:
            raise ConfigError(f"checkpoint.init_from_hf={path!r}: {e}") from None
    return path


@torch.no_grad()
def load_initial_weights(chunks, path: str) -> None:
    """Fill every parameter (and saved buffer) of this rank's ``chunks`` from the weights at ``path``,
    reading only this rank's slices. Local to the rank: no collective."""
    if not _is_engine_file(path):
        for chunk in chunks:
            load_hf_weights(chunk, path)
        return
    state = _engine_file(path)["state_dict"]  # memory-mapped: slicing reads only the pages it touches
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            spec = require_spec(p, name)
            if name not in state:
                raise CheckpointError(
                    f"{path} has no parameter {name!r}: write it again with tools/convert_hf.py import"
                )
            full = state[name]
            if name in VOCAB_TABLES and full.shape[0] < spec.full_shape[0]:  # this job pads the vocabulary
                full = torch.cat([full, full.new_zeros(spec.full_shape[0] - full.shape[0], *full.shape[1:])])
            elif name in VOCAB_TABLES and full.shape[0] > spec.full_shape[0]:  # the file's padding: cut off
                full = full[: spec.full_shape[0]]
            p.copy_(take_slice(full.reshape(spec.full_shape), spec.shards).reshape(p.shape))
        for name, b in chunk.named_buffers():
            if name in state and state[name].shape == b.shape:
                b.copy_(state[name])
