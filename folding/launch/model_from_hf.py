"""``model=from_hf``: the job's architecture read from ``checkpoint.init_from_hf``'s ``config.json``.

Starting from Hugging Face weights of a shape no preset has would otherwise take one override per
size. With ``model=from_hf checkpoint.init_from_hf=DIR`` the model is the source's (any family the
engine converts: :func:`folding.checkpoint.from_hf.source_model_config`), the MoE options included
(the source's router, its aux-loss coefficient as the default). ``model.*`` and ``moe.*`` overrides
given on the command line apply on top: training options freely, and those that contradict the source
are then refused by the start's check against the source, as for any preset. An override is told from
the ``from_hf`` node's placeholder values (:data:`folding.job.schema.FROM_HF_PLACEHOLDER`) by
differing from them: an override equal to the placeholder's value is taken from the source.

Usage::

    job = job_config_from_dict(resolve_from_hf(tree))   # the entry points, on the composed tree
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, Mapping

from ..checkpoint.from_hf import read_hf_source_config, source_model_config
from ..job.config import ConfigError, plain_tree
from ..job.schema import FROM_HF, from_hf_node


def resolve_from_hf(tree: Mapping[str, Any]) -> Dict[str, Any]:
    """``tree`` with its ``model`` and ``moe`` sections replaced by the source's, plus the overrides
    (see the module docstring); ``tree`` itself when its model is not ``from_hf``."""
    if (tree.get("model") or {}).get("name") != FROM_HF:
        return dict(tree)
    path = (tree.get("checkpoint") or {}).get("init_from_hf")
    if not path or not os.path.exists(os.path.expanduser(str(path))):
        raise ConfigError(
            f"model=from_hf takes the architecture from checkpoint.init_from_hf, which is {path!r}: set "
            "checkpoint.init_from_hf=DIR (a Hugging Face directory with config.json), or choose a preset"
        )
    source = plain_tree(dataclasses.asdict(source_model_config(os.path.expanduser(str(path)))))
    source_moe = source.pop("moe")
    node = from_hf_node()
    given_model = {k: v for k, v in (tree.get("model") or {}).items() if k != "name" and v != node["model"].get(k)}
    given_moe = {k: v for k, v in (tree.get("moe") or {}).items() if v != node["moe"].get(k)}
    notes = [*(tree.get("notes") or ()), _aux_loss_note(str(path), source_moe["aux_loss_coeff"], given_moe)]
    return {**tree, "model": {**source, **given_model}, "moe": {**source_moe, **given_moe}, "notes": notes}


def _aux_loss_note(path: str, source_coeff: float, given_moe: Mapping[str, Any]) -> str:
    """The start-up line saying where ``moe.aux_loss_coeff`` came from: the command line, or the source's
    ``router_aux_loss_coef`` (whatever its ``output_router_logits`` says, which only tells transformers
    whether a forward returns router logits; :mod:`folding.model.hf.config`)."""
    if "aux_loss_coeff" in given_moe:
        return (
            f"moe.aux_loss_coeff: {given_moe['aux_loss_coeff']} (command line; the source's "
            f"router_aux_loss_coef is {source_coeff})"
        )
    hf = read_hf_source_config(os.path.expanduser(path))
    if hf is None:  # an import file: its own model config
        return f"moe.aux_loss_coeff: {source_coeff} (the model config of {path})"
    flag = hf.get("output_router_logits")
    why = f"; its output_router_logits={str(flag).lower()} only says whether transformers returns router logits"
    return f"moe.aux_loss_coeff: {source_coeff} (router_aux_loss_coef of {path}/config.json{why if not flag else ''})"
