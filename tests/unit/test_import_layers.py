"""The package imports one way: ``overlap`` -> ``memory``, ``parallel``, ``quant``, ``data`` -> ``moe``
-> ``model`` -> ``pipeline`` -> ``optim`` -> ``job`` -> ``checkpoint`` -> ``training`` -> ``interop`` ->
``launch`` (``testing`` on top); ``planning`` imports only ``parallel`` and ``folding.model.config``, and
only ``training``, ``launch`` (and ``testing``) import ``planning``; ``pipeline`` never imports ``moe``
(the schedules know no MoE layer: the model hands them its per-step duties). ``overlap`` (the lanes,
deferred work, the exchange record, the runtime) is the ground floor: it imports nothing of the package,
and ``parallel`` imports it (the weight-gradient split of its linears). ``tools`` and ``benchmarks`` sit on
top of the package: they may import any of it, ``folding`` never imports them, and their modules import
one another without a cycle.

An import is an ``import``/``from`` statement or a call of ``importlib.import_module`` (or
``__import__``) with a string literal. No module imports the package's own modules (``folding``,
``tools``, ``benchmarks``) inside a function (a dodged cycle) or inside a ``try`` whose handler catches
an import failure (``ImportError``, ``ModuleNotFoundError``, ``Exception``, a bare ``except``, or a
tuple naming one of them)."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOPS = ("folding", "tools", "benchmarks")
LEVEL = {
    "overlap": 0,
    "memory": 1,
    "parallel": 1,
    "quant": 1,
    "data": 1,
    "moe": 2,
    "model": 3,
    "pipeline": 4,
    "optim": 5,
    "job": 6,
    "checkpoint": 7,
    "training": 8,
    "interop": 9,
    "launch": 10,
    "testing": 11,
}
FORBIDDEN = {("pipeline", "moe")}
"""Edges the level order allows that the package still does not take: ``(importer, imported)``."""
CATCHES_IMPORT_FAILURE = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
IMPORT_CALLS = {"import_module", "__import__"}


def sources():
    """``{module name: (source text, is a package)}`` of every file of ``folding``, ``tools`` and ``benchmarks``."""
    out = {}
    for top in TOPS:
        for root, _, files in os.walk(os.path.join(ROOT, top)):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    module = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
                    out[module] = (open(path, encoding="utf-8").read(), f == "__init__.py")
    return out


def _resolve(name: str, level: int, module: str, is_package: bool) -> str:
    """The absolute module name of a (possibly relative) import of ``name`` written in ``module``."""
    if not level:
        return name
    parts = (module if is_package else module.rsplit(".", 1)[0]).split(".")
    base = ".".join(parts[: len(parts) - level + 1])
    return f"{base}.{name}" if name else base


def imported(node, module: str, is_package: bool):
    """The names of modules of ``TOPS`` that an import statement or a literal ``import_module`` call names."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        target = _resolve(node.module or "", node.level, module, is_package)
        targets = [target] + [f"{target}.{a.name}" for a in node.names]
    elif (
        isinstance(node, ast.Call)
        and (getattr(node.func, "attr", None) in IMPORT_CALLS or getattr(node.func, "id", None) in IMPORT_CALLS)
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        name = node.args[0].value
        level = len(name) - len(name.lstrip("."))
        targets = [_resolve(name[level:], level, module, is_package)]
    else:
        return []
    return [t for t in targets if t.split(".")[0] in TOPS]


def allowed(src: str, dst: str) -> bool:
    """Whether module ``src`` may import module ``dst`` (both of ``TOPS``)."""
    a, b = src.split("."), dst.split(".")
    if a[0] != "folding":
        return True  # tools and benchmarks may import anything; their cycles are checked apart
    if b[0] != "folding":
        return False  # the package never imports its tools or benchmarks
    if len(a) < 2 or len(b) < 2 or a[1] == b[1]:
        return True
    sp, dp = a[1], b[1]
    if sp == "planning":
        return dp == "parallel" or dst.startswith("folding.model.config")
    if dp == "planning":
        return sp in ("training", "launch", "testing")
    return LEVEL[dp] < LEVEL[sp] and (sp, dp) not in FORBIDDEN


def _catches_import_failure(handler: ast.ExceptHandler) -> bool:
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(t is None or getattr(t, "id", getattr(t, "attr", None)) in CATCHES_IMPORT_FAILURE for t in types)


def _is_import(node) -> bool:
    return isinstance(node, (ast.Import, ast.ImportFrom, ast.Call))


def problems(srcs) -> list:
    """Every breach of the rules above in ``srcs`` (``{module: (source, is_package)}``), one line each."""
    found, graph = [], {}
    for module, (text, is_package) in srcs.items():
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if _is_import(node):
                dsts = imported(node, module, is_package)
                bad = [dst for dst in dsts if not allowed(module, dst)]
                if bad:  # one line per import: the first module it names against the order
                    found.append(f"{module}:{node.lineno} -> {bad[0]} (against the layer order)")
                graph.setdefault(module, set()).update(dsts)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [
                    f"{module}:{n.lineno} imports inside {node.name}()"
                    for n in ast.walk(node)
                    if _is_import(n) and imported(n, module, is_package)
                ]
            if isinstance(node, ast.Try) and any(_catches_import_failure(h) for h in node.handlers):
                found += [
                    f"{module}:{n.lineno} guards an import of the package"
                    for n in ast.walk(ast.Module(body=node.body, type_ignores=[]))
                    if _is_import(n) and imported(n, module, is_package)
                ]
    return found + [f"import cycle: {' -> '.join(c)}" for c in cycles(graph, set(srcs))]


def cycles(graph, modules) -> list:
    """Import cycles among the ``tools`` and ``benchmarks`` modules of ``graph`` (each reported once)."""
    top = {m for m in modules if m.split(".")[0] != "folding"}

    def targets(m):
        return {d for d in graph.get(m, ()) if d in top and d != m}

    out, state = [], {}

    def visit(m, path):
        state[m] = 1
        for d in sorted(targets(m)):
            if state.get(d) == 1:
                out.append(path[path.index(d) :] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(top):
        if m not in state:
            visit(m, [m])
    return out


def test_the_tree_follows_the_rules():
    found = problems(sources())
    assert not found, "\n".join(found)


def test_tools_and_benchmarks_are_covered():
    mods = sources()
    assert {"tools.plan", "benchmarks.bench_train", "folding.moe.layer"} <= set(mods)


@pytest.mark.parametrize(
    "src,dst,ok",
    [
        ("folding.moe.layer", "folding.model.config", False),
        ("folding.model.transformer", "folding.moe.layer", True),
        ("folding.planning.memory", "folding.pipeline.stage", False),
        ("folding.planning.flops", "folding.model.config", True),
        ("folding.optim.optimizer", "folding.planning.memory", False),
        ("folding.data.build", "folding.parallel", False),
        ("folding.testing.rank_pool", "benchmarks.breakdown", False),
        ("folding.model.hf.weights", "tools.convert_hf", False),
        ("tools.plan", "folding.training.trainer", True),
        ("folding.moe.dispatch.base", "folding.interop.megatron.stages", False),
        ("folding.checkpoint.load", "folding.training.trainer", False),
        ("folding.training.trainer", "folding.launch.run", False),
        ("folding.job.config", "folding.checkpoint.load", False),
        ("folding.launch.cli", "folding.interop.megatron.args", True),
        ("folding.interop.megatron.replace", "folding.moe.dispatch.build", True),
        ("benchmarks.bench_train", "tools.memory", True),
        ("folding.pipeline.stage", "folding.moe.layer", False),
        ("folding.pipeline.schedules", "folding.overlap.runtime", True),
        ("folding.pipeline.stage", "folding.model.chunks", True),
        ("folding.moe.dispatch.wire", "folding.overlap.exchange", True),
        ("folding.parallel.linear", "folding.overlap.wgrad", True),
        ("folding.overlap.lanes", "folding.parallel.state", False),
        ("folding.overlap.exchange", "folding.moe.dispatch.wire", False),
        ("folding.overlap.runtime", "folding.testing.link_model", False),
        ("folding.moe.dispatch.wire", "folding.testing.link_model", False),
    ],
)
def test_the_rule_itself(src, dst, ok):
    assert allowed(src, dst) is ok


# Each hole the checker must close, planted as a module of its own next to a clean one; the message it must give.
PLANTED = {
    "importlib": (
        "folding.moe.planted",
        "import importlib\nT = importlib.import_module('folding.training.trainer')\n",
        "folding.moe.planted:2 -> folding.training.trainer (against the layer order)",
    ),
    "dunder import": (
        "folding.moe.planted",
        "T = __import__('folding.training.trainer')\n",
        "folding.moe.planted:1 -> folding.training.trainer (against the layer order)",
    ),
    "relative importlib": (
        "folding.moe.planted",
        "import importlib\nT = importlib.import_module('..training', __name__)\n",
        "folding.moe.planted:2 -> folding.training (against the layer order)",
    ),
    "tuple guard": (
        "folding.moe.planted",
        "try:\n    from folding.moe import router\nexcept (ImportError, ModuleNotFoundError):\n    router = None\n",
        "folding.moe.planted:2 guards an import of the package",
    ),
    "bare guard": (
        "folding.moe.planted",
        "try:\n    from . import router\nexcept:\n    router = None\n",
        "folding.moe.planted:2 guards an import of the package",
    ),
    "importlib in a function": (
        "folding.training.planted",
        "import importlib\ndef f():\n    return importlib.import_module('folding.model.hf.weights')\n",
        "folding.training.planted:3 imports inside f()",
    ),
    "engine imports the Megatron adapter": (
        "folding.moe.planted",
        "from folding.interop.megatron import replace_dispatcher\n",
        "folding.moe.planted:1 -> folding.interop.megatron (against the layer order)",
    ),
    "package imports a tool": (
        "folding.testing.planted",
        "from tools.convert_hf import main\n",
        "folding.testing.planted:1 -> tools.convert_hf (against the layer order)",
    ),
    "package imports a benchmark": (
        "folding.testing.planted",
        "import benchmarks.breakdown\n",
        "folding.testing.planted:1 -> benchmarks.breakdown (against the layer order)",
    ),
    "tool imports in a function": (
        "tools.planted",
        "def main():\n    from folding.model.presets import get_preset\n",
        "tools.planted:2 imports inside main()",
    ),
    "benchmark cycle": (
        "benchmarks.planted_a",
        "from benchmarks import planted_b\n",
        "import cycle: benchmarks.planted_a -> benchmarks.planted_b -> benchmarks.planted_a",
    ),
}


@pytest.mark.parametrize("hole", sorted(PLANTED))
def test_each_planted_hole_fails(hole):
    module, text, message = PLANTED[hole]
    srcs = {"folding.moe.routing.router": ("import torch\n", False), module: (text, False)}
    if hole == "benchmark cycle":
        srcs["benchmarks.planted_b"] = ("from benchmarks.planted_a import X\n", False)
    assert problems(srcs) == [message]


def test_clean_planted_modules_pass():
    srcs = {
        "folding.training.planted": (
            "import importlib\nM = importlib.import_module('folding.model.hf.weights')\n",
            False,
        ),
        "folding.model.planted": (
            "try:\n    import transformers\nexcept (ImportError, ModuleNotFoundError):\n    pass\n",
            False,
        ),
        "tools.planted": ("from benchmarks.breakdown import breakdown\nfrom folding.training import trainer\n", False),
    }
    assert problems(srcs) == []
