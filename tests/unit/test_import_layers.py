"""The package imports one way: ``parallel``, ``quant``, ``data`` -> ``moe`` -> ``model`` -> ``pipeline``
-> ``optim`` -> ``training`` (``testing`` on top); ``planning`` imports only ``parallel`` and
``folding.model.config``, and only ``training`` (and ``testing``) import ``planning``. No module imports
the package's own modules inside a function (a dodged cycle) or behind an ``ImportError`` guard."""

import ast
import os

import pytest

PKG = os.path.join(os.path.dirname(__file__), "..", "..", "folding")
LEVEL = {
    "parallel": 0,
    "quant": 0,
    "data": 0,
    "moe": 1,
    "model": 2,
    "pipeline": 3,
    "optim": 4,
    "training": 5,
    "testing": 6,
}


def modules():
    """``(module name, parsed tree, is a package)`` of every file of the package."""
    for root, _, files in os.walk(PKG):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].replace(os.sep, ".")
                module = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
                tree = ast.parse(open(path, encoding="utf-8").read())
                yield module, tree, path.endswith("__init__.py")


def imported(node, module: str, is_package: bool):
    """The ``folding.*`` module names an import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "folding"]
    base = module if is_package else module.rsplit(".", 1)[0]
    if node.level:
        parts = base.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1])
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module or ""
    if target.split(".")[0] != "folding":
        return []
    return [target] + [f"{target}.{a.name}" for a in node.names]


def allowed(src: str, dst: str) -> bool:
    a, b = src.split("."), dst.split(".")
    if len(a) < 2 or len(b) < 2 or a[1] == b[1]:
        return True
    sp, dp = a[1], b[1]
    if sp == "planning":
        return dp == "parallel" or dst.startswith("folding.model.config")
    if dp == "planning":
        return sp in ("training", "testing")
    return LEVEL[dp] < LEVEL[sp]


def edges():
    out = []
    for module, tree, is_package in modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out.extend((module, dst, node.lineno) for dst in imported(node, module, is_package))
    return out


def test_imports_follow_the_layers():
    bad = sorted(
        {
            (src, dst.rsplit(".", 1)[0] if dst.count(".") > 2 else dst, line)
            for src, dst, line in edges()
            if not allowed(src, dst)
        }
    )
    assert not bad, "imports against the layer order:\n" + "\n".join(f"  {s}:{ln} -> {d}" for s, d, ln in bad)


def test_no_function_level_or_guarded_imports_of_the_package():
    found = []
    for module, tree, is_package in modules():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [
                    f"{module}:{n.lineno} imports inside {fn.name}()"
                    for n in ast.walk(fn)
                    if isinstance(n, (ast.Import, ast.ImportFrom)) and imported(n, module, is_package)
                ]
            if isinstance(fn, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in fn.handlers
            ):
                found += [
                    f"{module}:{n.lineno} guards an import of the package"
                    for n in ast.walk(fn)
                    if isinstance(n, (ast.Import, ast.ImportFrom)) and imported(n, module, is_package)
                ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "src,dst,ok",
    [
        ("folding.moe.layer", "folding.model.config", False),
        ("folding.model.transformer", "folding.moe.layer", True),
        ("folding.planning.memory", "folding.pipeline.stage", False),
        ("folding.planning.flops", "folding.model.config", True),
        ("folding.optim.optimizer", "folding.planning.memory", False),
        ("folding.data.build", "folding.parallel", False),
    ],
)
def test_the_rule_itself(src, dst, ok):
    assert allowed(src, dst) is ok
