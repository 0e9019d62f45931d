"""Convert a Megatron-Core ``torch_dist`` checkpoint into an engine checkpoint.

::

    python -m tools.convert_megatron --load MEGATRON_DIR --out ENGINE_DIR --model mixtral_8x7b [model.K=V ...]

``--load`` is what Megatron-LM's ``--save`` / ``--load`` named (the directory holding
``latest_checkpointed_iteration.txt``: its latest iteration) or one ``iter_<N>`` directory, saved in any
TP/PP/EP/ETP layout. A torch_dist store holds no model config an engine could use, so the model is
given: ``--model`` names a preset (``folding.model.presets``) and ``model.K=V`` / ``moe.K=V`` override its
fields, as on the training command line (``model.num_layers=2 moe.num_experts=4``). The checkpoint is
checked against that model by name and global shape before anything is written; what it cannot
check is the routing (``moe.topk``, ``moe.pre_softmax``, ``moe.score_function``) and ``model.rope_theta``,
which must be Megatron's (``--moe-router-topk``, ``--moe-router-pre-softmax``, ``--moe-router-score-function``,
``--rotary-base``). ``ENGINE_DIR/step_<N>`` is written (``N``: Megatron's iteration), read by
``folding.checkpoint.load.load_model``, ``tools/convert_hf.py export --checkpoint`` and, directly from the
Megatron directory, ``checkpoint.init_from_megatron``. ``--out`` must not exist.

Exit status 0 on success, 2 on a checkpoint or model that does not fit (the message names each tensor).
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, List

import yaml

from folding.checkpoint.from_megatron import convert_megatron
from folding.job.config import ConfigError
from folding.model.hf.errors import CheckpointError
from folding.model.presets import get_preset


def _value(text: str):
    """``text`` as YAML, with numbers YAML 1.1 reads as strings (``1e-06``) read as numbers."""
    parsed = yaml.safe_load(text)
    if isinstance(parsed, str):
        try:
            return float(parsed)
        except ValueError:
            return parsed
    return parsed


def model_config(preset: str, overrides: List[str]):
    """The :class:`~folding.model.config.ModelConfig` of preset ``preset`` with ``model.K=V`` / ``moe.K=V``
    ``overrides`` (values parsed as YAML: numbers, booleans, null, lists)."""
    model: Dict[str, object] = {}
    moe: Dict[str, object] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        group, _, field = key.partition(".")
        if not sep or group not in ("model", "moe") or not field or "." in field:
            raise ValueError(f"override {item!r}: write model.FIELD=VALUE or moe.FIELD=VALUE")
        parsed = _value(value)
        (model if group == "model" else moe)[field] = tuple(parsed) if isinstance(parsed, list) else parsed
    if moe:
        model["moe"] = moe
    return get_preset(preset, **model)


def main(argv=None) -> int:
    """Parse the command line, convert, print the written checkpoint; return the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="Megatron checkpoint directory (or one iter_<N> in it)")
    p.add_argument("--out", required=True, help="new directory for the engine checkpoint (must not exist)")
    p.add_argument("--model", required=True, help="the engine's model preset (folding.model.presets)")
    p.add_argument("overrides", nargs="*", help="model.FIELD=VALUE / moe.FIELD=VALUE")
    args = p.parse_args(argv)
    try:
        cfg = model_config(args.model, args.overrides)
        path = convert_megatron(args.load, args.out, cfg)
    except (CheckpointError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
