"""A Megatron-LM command line as this engine's Hydra overrides (``python -m tools.megatron_args``).

:func:`convert` reads the flags of a Megatron-LM ``pretrain_gpt.py`` command (parallel layout, model,
MoE, optimizer, data, checkpoints; the table is :data:`folding.interop.megatron.flags.FLAGS`) and
returns the overrides of ``examples/pretrain_mixtral.py`` that describe the same job, with notes for
what is accepted but differs or changes nothing here. A flag without an equivalent is refused by name
(:class:`MegatronArgsError` lists them all), and so is a model that relies on Megatron-LM defaults this
engine does not build (LayerNorm, learned positions, GeLU, linear biases).

The model: when the command's sizes are those of a preset (``mixtral_8x7b``, ...), the result selects
it (``model=mixtral_8x7b``) and sets only what differs; otherwise it sets every size on the default
preset and names the model ``megatron``. With ``config_dir`` (the job's ``configs/``), the keys a
Megatron-LM command leaves at Megatron-LM's defaults are set to those defaults where this engine's
differ (:data:`~folding.interop.megatron.flags.MEGATRON_DEFAULTS`: ``optim.beta2=0.999``, ...).

Usage::

    result = convert(["--tensor-model-parallel-size", "2", "--num-experts", "8"], world_size=8)
    result.overrides   # ["parallel.tp=2", "parallel.etp=2", ...]; result.notes
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ...job.compose import compose_tree
from ...job.schema import register_schema
from ...model.presets import get_preset, list_presets
from .flags import FLAGS, MEGATRON_DEFAULTS
from .specials import specials as _specials

ARCH_KEYS = (
    "model.hidden_size",
    "model.num_layers",
    "model.num_attention_heads",
    "model.num_kv_heads",
    "moe.num_experts",
    "moe.topk",
    "moe.ffn_hidden_size",
)
"""The sizes that pick a preset when they all match it."""

MULTI_VALUED = ("--data-path", "--recompute-modules", "--offload-modules", "--cp-comm-type")
"""The flags that take several values (Megatron-LM's ``nargs``)."""

SECTIONS = ("parallel", "model", "moe", "train", "optim", "data", "checkpoint", "logging")
"""The order the overrides are printed in."""


class MegatronArgsError(ValueError):
    """A Megatron-LM command line that cannot be converted; ``unsupported`` lists the flags refused."""

    def __init__(self, problems: List[str], unsupported: List[str]):
        self.problems, self.unsupported = problems, unsupported
        super().__init__("; ".join(problems))


@dataclasses.dataclass
class Conversion:
    """The overrides of one Megatron-LM command line."""

    overrides: List[str]
    """``key=value`` Hydra overrides (and ``model=<preset>`` first when a preset matched)."""
    notes: List[str]
    """What was accepted without a key, or differs from Megatron-LM, one sentence each."""
    values: Dict[str, Any]
    """The overrides as typed values (``{"parallel.tp": 2, ...}``), without ``model=<preset>``."""
    preset: Optional[str]
    """The preset whose sizes the command's model has, if any."""


def parse_flags(argv: Sequence[str]) -> Tuple[Dict[str, List[str]], List[str]]:
    """``argv`` as ``{flag: [values]}`` (a repeated flag: the last) and the order of appearance.
    A flag's values are the tokens up to the next ``--`` token; ``--flag=value`` is one value."""
    flags: Dict[str, List[str]] = {}
    order: List[str] = []
    current = None
    for tok in argv:
        if tok.startswith("--"):
            name, eq, val = tok.partition("=")
            current = name
            flags[name] = [val] if eq else []
            order.append(name)
        elif current is None:
            raise MegatronArgsError([f"{tok!r} comes before any flag: give Megatron-LM's flags (--name value)"], [])
        else:
            flags[current].append(tok)
    return flags, order


def hydra_value(v: Any) -> str:
    """``v`` as a Hydra override value: ``null``, ``true``, numbers, ``[a,b]``, plain or quoted strings."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    s = str(v)
    if re.fullmatch(r"[A-Za-z0-9_./:+-]+", s) and s not in ("null", "true", "false"):
        return s
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def convert(argv: Sequence[str], *, world_size: Optional[int] = None, config_dir: Optional[str] = None) -> Conversion:
    """The overrides for the Megatron-LM flags ``argv`` (see the module docstring).

    ``world_size`` (the launched ranks, when known) sets ``parallel.world_size`` and Megatron-LM's
    default global batch (one micro-batch per DP rank). ``config_dir``: compare with this engine's
    composed defaults and add Megatron-LM's where they differ; without it only the given flags convert.
    Raises :class:`MegatronArgsError` naming every flag or value without an equivalent.
    """
    flags, order = parse_flags(argv)
    out: Dict[str, Any] = {}
    notes: List[str] = []
    problems: List[str] = []
    unsupported = [f for f in order if f not in FLAGS]
    if unsupported:
        problems.append(
            "unsupported Megatron-LM flags (no equivalent in folding): " + ", ".join(dict.fromkeys(unsupported))
        )
    for name in order:
        spec = FLAGS.get(name)
        if spec is None:
            continue
        vals = flags[name]
        if spec.takes_value and len(vals) != 1 and name not in MULTI_VALUED:
            problems.append(f"{name} takes one value (got {len(vals)})")
            continue
        if not spec.takes_value and vals:
            problems.append(f"{name} takes no value (got {' '.join(vals)})")
            continue
        if spec.refused:
            problems.append(f"{name}: {spec.refused}")
            continue
        if spec.choices and vals[0] not in spec.choices:
            problems.append(f"{name} {vals[0]}: no equivalent here; folding supports {' or '.join(spec.choices)}")
            continue
        if spec.note:
            notes.append(f"{name}: {spec.note}")
        if spec.special or not spec.key:
            continue
        try:
            out[spec.key] = spec.convert(vals[0]) if spec.takes_value else spec.fixed
        except ValueError:
            problems.append(f"{name} {vals[0]!r} is not a valid value")
    _specials(flags, out, notes, problems)
    if problems:
        refused = [f for f in order if f in FLAGS and FLAGS[f].refused]
        raise MegatronArgsError(problems, list(dict.fromkeys(unsupported + refused)))
    if world_size is not None:
        out["parallel.world_size"] = world_size
        if "train.global_batch_size" not in out and "--micro-batch-size" in flags:
            dp = world_size // (out.get("parallel.tp", 1) * out.get("parallel.cp", 1) * out.get("parallel.pp", 1))
            out["train.global_batch_size"] = out["train.micro_batch_size"] * dp
            notes.append("--global-batch-size not given: Megatron-LM's default, one micro-batch per DP rank")
    elif "--micro-batch-size" in flags and "--global-batch-size" not in flags:
        notes.append("--global-batch-size not given: set train.global_batch_size (Megatron-LM: micro-batch x DP)")
    given = set(out)
    preset = _match_preset(out)
    if preset is not None:  # the preset sets its own sizes: only what differs stays
        ref = _flat_preset(preset)
        out = {k: v for k, v in out.items() if not (k in ref and _same(v, ref[k]))}
    mla = {k: v for k, v in out.items() if k.startswith("model.mla.")}
    if mla:  # MLA sizes are a preset's (model.mla): left over, they match none
        with_mla = [n for n in list_presets() if get_preset(n).mla is not None]
        raise MegatronArgsError(
            [
                f"--multi-latent-attention sizes {mla} are not those of the model the other sizes give "
                f"({preset or 'none'}): folding builds MLA from a preset's model.mla ({', '.join(with_mla)})"
            ],
            [],
        )
    elif "model.num_layers" in out:
        out["model.name"] = "megatron"
        if "model.vocab_size" not in out:
            notes.append("the vocabulary size comes from Megatron-LM's tokenizer: set model.vocab_size")
    if config_dir is not None:
        base = _composed_defaults(config_dir, preset)
        implied = [
            (key, default)
            for key, default, triggers in MEGATRON_DEFAULTS
            if key not in given and any(t in flags for t in triggers) and not _same(default, base.get(key, _MISSING))
        ]
        out.update(implied)
        if implied:
            notes.append("Megatron-LM's defaults where folding's differ: " + ", ".join(k for k, _ in implied))
    head = [f"model={preset}"] if preset else []
    out = dict(sorted(out.items(), key=lambda kv: SECTIONS.index(kv[0].split(".")[0])))
    return Conversion(
        overrides=head + [f"{k}={hydra_value(v)}" for k, v in out.items()], notes=notes, values=out, preset=preset
    )


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    """Equal values; numbers compared as numbers (``0.01 == 1e-2``), never a bool as a number."""
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
    if number(a) and number(b):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return type(a) is type(b) and a == b


def _flat(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _flat_preset(name: str) -> Dict[str, Any]:
    cfg = dataclasses.asdict(get_preset(name))
    moe = cfg.pop("moe")
    return {**_flat(cfg, "model."), **_flat(moe, "moe.")}


def _composed_defaults(config_dir: str, preset: Optional[str]) -> Dict[str, Any]:
    register_schema()
    return _flat(compose_tree([f"model={preset}"] if preset else [], config_dir=config_dir, config_name="config"))


def _match_preset(out: Dict[str, Any]) -> Optional[str]:
    given = {k: out[k] for k in ARCH_KEYS if k in out}
    if len(given) < len(ARCH_KEYS) - 1:  # a command that does not define the model
        return None
    for name in list_presets():
        ref = _flat_preset(name)
        if (
            all(ref.get(k) == v for k, v in given.items())
            and out.get("model.vocab_size", ref["model.vocab_size"]) == ref["model.vocab_size"]
        ):
            return name
    return None
