"""Snapshot of the TransformerEngine API the engine relies on, parsed from TE's own Python sources.

TransformerEngine cannot be imported on a machine without CUDA, but its wheel carries its Python
sources. This tool parses them (``ast``; nothing is imported or executed) and writes one JSON file:

- ``callables``: the signature (parameters, kinds, defaults as source text) of every TE callable the
  engine (:data:`folding.moe.experts.te.TE_API`) or the tests' CPU stand-in of TE uses; the recipes'
  dataclass fields and defaults; whether a callable is deprecated;
- ``extra_state``: what ``get_extra_state`` returns per recipe and the rule by which
  ``set_extra_state`` accepts a payload (the unsafe-pickle opt-in ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE``),
  recorded as control flow with expressions as source text, which ``tests/te_rules.py`` executes;
- ``delayed_meta``: where the ``delayed`` recipe keeps its scales and amax histories;
- ``grouped_linear``: ``use_grouped_tensor`` (default, environment fallback, meaning), the
  ``m_splits`` and CUDA checks, the weight parameter names;
- ``alignment`` and ``shape_rules``: the grouped-GEMM row alignment per recipe
  (``get_align_size_for_quantization``) and the dimension multiples FP8 / MXFP8 quantization needs.

The committed ``tests/data/te_api_2.20.2.json`` was made with (``DIR``: any scratch directory outside
the repository; the 729 MB wheel is never committed; its header records this command)::

    pip download --no-deps transformer-engine-cu12==2.20.2 -d DIR
    python -m tools.te_api_snapshot DIR/transformer_engine_cu12-2.20.2-py3-none-manylinux_2_28_x86_64.whl \\
        --out tests/data/te_api_2.20.2.json

Usage: ``python -m tools.te_api_snapshot WHEEL_OR_SOURCE_DIR --out FILE.json`` (a wheel, or a
directory holding ``transformer_engine/``: an unpacked wheel or a source checkout).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import sys

from tools.te_api_rules import (
    PT,
    RECIPE_MODULE,
    RECIPES,
    alignment,
    delayed_meta,
    extra_state,
    grouped_linear,
    shape_rules,
)
from tools.te_api_source import SourceTree, calls_named, dataclass_fields, is_dataclass, signature

CALLABLES = (
    f"{PT}.GroupedLinear",
    f"{PT}.GroupedLinear.forward",
    f"{PT}.GroupedLinear.get_extra_state",
    f"{PT}.GroupedLinear.set_extra_state",
    f"{PT}.GroupedLinear.init_fp8_meta_tensors",
    f"{PT}.autocast",
    f"{PT}.fp8_autocast",
    f"{PT}.is_fp8_available",
    f"{PT}.is_fp8_block_scaling_available",
    f"{PT}.is_mxfp8_available",
    f"{PT}.quantization.get_align_size_for_quantization",
) + tuple(f"{RECIPE_MODULE}.{r}" for r in RECIPES)
"""Every TE callable the engine or the stand-in uses (a class: its constructor)."""


def callable_record(src: SourceTree, dotted: str) -> dict:
    """Signature, kind, defining module and deprecation of one public TE name."""
    node, module = src.find(dotted)
    rec = {"defined_in": module}
    if isinstance(node, ast.ClassDef):
        if is_dataclass(node):
            fields = []
            for base, _ in reversed(src.bases(node, module)):
                if is_dataclass(base):
                    fields += dataclass_fields(base)
            rec.update(kind="dataclass", params=fields + dataclass_fields(node))
        else:
            init, _ = src.member(node, module, "__init__")
            rec.update(kind="class", params=signature(init))
            node = init
    else:
        in_class = any(isinstance(c, ast.ClassDef) and node in c.body for c in ast.walk(src.tree(module)))
        rec.update(kind="method" if in_class else "function", params=signature(node, bound=in_class))
    for call in calls_named(node, "warn"):
        text = ast.unparse(call)
        if "DeprecationWarning" in text and "deprecated" in text:
            rec["deprecated"] = ast.literal_eval(call.args[0]) if isinstance(call.args[0], ast.Constant) else text
    return rec


def snapshot(path: str, command: str) -> dict:
    """The whole snapshot of the sources at ``path``; ``command`` is recorded as made-by."""
    src = SourceTree.open(path)
    digest = None
    if os.path.isfile(path):
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    parsed = ("", "._extra_state", ".module.base", ".module.grouped_linear", ".quantization", ".utils", ".constants")
    modules = sorted({PT + m for m in parsed} | {f"{PT}.tensor.mxfp8_tensor", RECIPE_MODULE})
    return {
        "header": {
            "made_by": command,
            "source": src.origin,
            "source_sha256": digest,
            "version": src.version,
            "parsed_sha256": {m: src.sha256(m) for m in modules},
            "note": "parsed with ast; nothing imported. Expressions are normalized source text (ast.unparse).",
        },
        "callables": {name: callable_record(src, name) for name in CALLABLES},
        "extra_state": extra_state(src),
        "delayed_meta": delayed_meta(src),
        "grouped_linear": grouped_linear(src),
        "alignment": alignment(src),
        "shape_rules": shape_rules(src),
    }


def main(argv=None) -> int:
    """Parse the sources and write the JSON (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("source", help="TransformerEngine wheel (.whl) or a directory holding transformer_engine/")
    p.add_argument("--out", required=True, help="JSON file to write, e.g. tests/data/te_api_2.20.2.json")
    args = p.parse_args(argv)
    shown = f"python -m tools.te_api_snapshot {os.path.basename(args.source)} --out {args.out}"
    if args.source.endswith(".whl"):  # the wheel comes from the package index
        name, version = os.path.basename(args.source).split("-")[:2]
        shown = f"pip download --no-deps {name.replace('_', '-')}=={version} -d DIR && " + shown.replace(
            " transformer", " DIR/transformer", 1
        )
    snap = snapshot(args.source, shown)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(snap, f, indent=1, sort_keys=False)
        f.write("\n")
    print(
        f"{args.out}: {len(snap['callables'])} callables from {snap['header']['source']} ({snap['header']['version']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
