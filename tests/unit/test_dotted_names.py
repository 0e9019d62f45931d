"""Every dotted ``folding.`` name the code and the docs show a reader resolves: in the strings (docstrings,
error messages) and comments of every ``.py`` file under ``folding/``, ``tools/``, ``benchmarks/`` and
``examples/``, and in every Markdown file of the repository. A name resolves when its longest importable
prefix is a module and the rest is an attribute walk from it (a dataclass field counts as an attribute)."""

import ast
import dataclasses
import importlib
import io
import os
import re
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CODE_DIRS = ("folding", "tools", "benchmarks", "examples")
NAME = re.compile(r"(?<![\w./-])folding(?:\.[A-Za-z_]\w*)+")


def resolves(name: str) -> bool:
    """Whether ``name`` (``folding.x.y.attr...``) names a module or an attribute reachable from one."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    for attr in parts[i:]:
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
        elif (
            isinstance(obj, type)
            and dataclasses.is_dataclass(obj)
            and attr in {f.name for f in dataclasses.fields(obj)}
        ):
            obj = None  # a field without a class-level default: nothing further to walk
        else:
            return False
    return True


def _python_texts(path):
    src = open(path, encoding="utf-8").read()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def texts():
    """``(file, line, text)`` of every string and comment of the code and of every Markdown file."""
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "outputs", "multirun")]
        rel_top = os.path.relpath(top, ROOT)
        for f in sorted(files):
            path = os.path.join(top, f)
            rel = os.path.relpath(path, ROOT)
            if f.endswith(".md"):
                for i, line in enumerate(open(path, encoding="utf-8"), 1):
                    yield rel, i, line
            elif f.endswith(".py") and rel_top.split(os.sep)[0] in CODE_DIRS:
                for line, text in _python_texts(path):
                    yield rel, line, text


def test_every_dotted_name_resolves():
    seen, bad = 0, []
    for path, line, text in texts():
        for m in NAME.finditer(text):
            seen += 1
            if not resolves(m.group(0)):
                bad.append(f"{path}:{line}: {m.group(0)}")
    assert seen > 100  # the scan reads what it should
    assert not bad, "dotted names that do not resolve:\n" + "\n".join(bad)


def test_the_resolver_itself():
    assert resolves("folding.parallel.params.shard_index")
    assert resolves("folding.model.chunks.build_stage_chunks")
    assert resolves("folding.moe.config.MoEConfig.num_experts")
    assert not resolves("folding.model.init.shard_index")
    assert not resolves("folding.pipeline.stage.build_stage_chunks")
    assert [m.group(0) for m in NAME.finditer("see folding.model.chunks. and docs/folding.md")] == [
        "folding.model.chunks"
    ]
