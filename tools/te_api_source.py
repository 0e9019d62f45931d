"""Read TransformerEngine's Python sources without importing them: a wheel or a source tree, parsed by ``ast``.

Used by :mod:`tools.te_api_snapshot` to record the API the engine relies on, and by the tests to
read the CPU stand-in of TransformerEngine the same way (so the two are compared as parsed).

Usage::

    src = SourceTree.open("transformer_engine_cu12-2.20.2-py3-none-manylinux_2_28_x86_64.whl")
    node, module = src.find("transformer_engine.pytorch.GroupedLinear.forward")
    params = signature(node)       # [{"name": "inp", "kind": "POSITIONAL_OR_KEYWORD"}, ...]
"""

from __future__ import annotations

import ast
import hashlib
import os
import zipfile
from typing import Dict, List, Optional, Tuple

PACKAGE = "transformer_engine"
"""The top-level package whose sources are read."""


class SourceTree:
    """The ``.py`` files of one TransformerEngine release, by dotted module name, parsed lazily."""

    def __init__(self, files: Dict[str, bytes], *, origin: str, version: Optional[str]):
        """``files``: path inside the package tree (``transformer_engine/pytorch/fp8.py``) -> bytes."""
        self.files, self.origin, self.version = files, origin, version
        self._trees: Dict[str, ast.Module] = {}

    @classmethod
    def open(cls, path: str) -> "SourceTree":
        """A wheel (``.whl``, read as a zip) or a directory holding ``transformer_engine/`` (an
        unpacked wheel or a source checkout)."""
        files, version = {}, None
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                for name in z.namelist():
                    if name.startswith(PACKAGE + "/") and name.endswith(".py"):
                        files[name] = z.read(name)
                    elif name.endswith(".dist-info/METADATA"):
                        version = _metadata_version(z.read(name).decode("utf-8", "replace"))
        elif os.path.isdir(os.path.join(path, PACKAGE)):
            for root, _, names in os.walk(os.path.join(path, PACKAGE)):
                for n in names:
                    if n.endswith(".py"):
                        full = os.path.join(root, n)
                        with open(full, "rb") as f:
                            files[os.path.relpath(full, path).replace(os.sep, "/")] = f.read()
            for n in os.listdir(path):
                if n.endswith(".dist-info") and os.path.exists(os.path.join(path, n, "METADATA")):
                    with open(os.path.join(path, n, "METADATA"), encoding="utf-8") as f:
                        version = _metadata_version(f.read())
        else:
            raise SystemExit(f"{path}: neither a wheel nor a directory holding {PACKAGE}/")
        if not files:
            raise SystemExit(f"{path}: no {PACKAGE}/*.py sources found")
        return cls(files, origin=os.path.basename(os.path.normpath(path)), version=version)

    def module_path(self, module: str) -> Optional[str]:
        """The file of dotted ``module`` (``a/b.py`` or ``a/b/__init__.py``), or None."""
        base = module.replace(".", "/")
        for cand in (base + ".py", base + "/__init__.py"):
            if cand in self.files:
                return cand
        return None

    def tree(self, module: str) -> ast.Module:
        """The parsed source of dotted ``module``."""
        if module not in self._trees:
            path = self.module_path(module)
            if path is None:
                raise KeyError(f"no module {module} in {self.origin}")
            self._trees[module] = ast.parse(self.files[path], filename=path)
        return self._trees[module]

    def sha256(self, module: str) -> str:
        """Digest of the source file of ``module`` (recorded so a changed file is visible)."""
        return hashlib.sha256(self.files[self.module_path(module)]).hexdigest()

    def find(self, dotted: str) -> Tuple[ast.AST, str]:
        """The definition (``ClassDef`` / ``FunctionDef`` / ``Assign``) a public dotted name refers to,
        following ``import`` re-exports and base classes, with the module that defines it."""
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if self.module_path(module) is not None:
                break
        else:
            raise KeyError(f"{dotted}: no module of it in {self.origin}")
        node, module = self.top_level(module, parts[cut])
        for attr in parts[cut + 1 :]:
            if isinstance(node, ast.Module):
                node, module = self.top_level(module, attr)
            else:
                node, module = self.member(node, module, attr)
        return node, module

    def top_level(self, module: str, name: str) -> Tuple[ast.AST, str]:
        """The top-level definition of ``name`` in ``module``, or where its import leads."""
        for stmt in self.tree(module).body:
            if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return stmt, module
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return stmt, module
        for stmt in ast.walk(self.tree(module)):  # imports, also inside try/if blocks
            if isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        target = self._import_base(module, stmt)
                        sub = f"{target}.{alias.name}"
                        if self.module_path(sub) is not None:  # a submodule
                            return self.tree(sub), sub
                        return self.top_level(target, alias.name)
        raise KeyError(f"{name} is not defined in {module}")

    def member(self, cls: ast.AST, module: str, name: str) -> Tuple[ast.AST, str]:
        """Method or class attribute ``name`` of class ``cls``, searching its bases depth-first."""
        if not isinstance(cls, ast.ClassDef):
            raise KeyError(f"{name}: {getattr(cls, 'name', cls)} in {module} is not a class")
        for stmt in cls.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return stmt, module
        for base in cls.bases:
            if isinstance(base, ast.Name):
                try:
                    node, mod = self.top_level(module, base.id)
                    return self.member(node, mod, name)
                except KeyError:
                    continue
        raise KeyError(f"{cls.name}.{name} not found (from {module})")

    def bases(self, cls: ast.ClassDef, module: str) -> List[Tuple[ast.ClassDef, str]]:
        """The classes ``cls`` derives from that are defined in these sources, nearest first."""
        out = []
        for base in cls.bases:
            if isinstance(base, ast.Name):
                try:
                    node, mod = self.top_level(module, base.id)
                except KeyError:
                    continue
                if isinstance(node, ast.ClassDef):
                    out += [(node, mod)] + self.bases(node, mod)
        return out

    def _import_base(self, module: str, stmt: ast.ImportFrom) -> str:
        if not stmt.level:
            return stmt.module
        is_pkg = self.module_path(module).endswith("__init__.py")
        pkg = module.split(".")
        pkg = pkg[: len(pkg) - stmt.level + (1 if is_pkg else 0)]
        return ".".join(pkg + ([stmt.module] if stmt.module else []))


def _metadata_version(text: str) -> Optional[str]:
    for line in text.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return None


KINDS = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "VAR_POSITIONAL", "KEYWORD_ONLY", "VAR_KEYWORD")
"""Parameter kinds, named as ``inspect.Parameter`` names them."""


def signature(fn: ast.AST, *, bound: bool = True) -> List[dict]:
    """Parameters of a ``def`` in order: ``{"name", "kind"[, "default"]}``, defaults as normalized
    source text (``ast.unparse``). ``bound``: drop the first parameter (``self`` / ``cls``)."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = []
    for i, (arg, d) in enumerate(zip(positional, defaults)):
        out.append(_param(arg.arg, KINDS[0] if i < len(a.posonlyargs) else KINDS[1], d))
    if a.vararg:
        out.append(_param(a.vararg.arg, KINDS[2], None))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append(_param(arg.arg, KINDS[3], d))
    if a.kwarg:
        out.append(_param(a.kwarg.arg, KINDS[4], None))
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    return out[1:] if bound and not static else out


def _param(name: str, kind: str, default: Optional[ast.AST]) -> dict:
    rec = {"name": name, "kind": kind}
    if default is not None:
        rec["default"] = ast.unparse(default)
    return rec


def is_dataclass(cls: ast.ClassDef) -> bool:
    """Whether ``cls`` is decorated with ``@dataclass`` (with or without arguments)."""
    for d in cls.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if (isinstance(target, ast.Name) and target.id == "dataclass") or (
            isinstance(target, ast.Attribute) and target.attr == "dataclass"
        ):
            return True
    return False


def dataclass_fields(cls: ast.ClassDef) -> List[dict]:
    """The dataclass fields ``cls`` declares itself (annotated class attributes, ``ClassVar`` excluded)
    in order, as constructor parameters: ``{"name", "kind", "default"}``."""
    out = []
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            if "ClassVar" in ast.unparse(stmt.annotation):
                continue
            out.append(_param(stmt.target.id, KINDS[1], stmt.value))
    return out


def constant(module_tree: ast.Module, name: str):
    """The literal value assigned to module-level ``name`` (``ast.literal_eval``)."""
    for stmt in module_tree.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return ast.literal_eval(stmt.value)
    raise KeyError(name)


def flow(stmts: List[ast.stmt]) -> List[dict]:
    """The control flow of ``stmts`` as data a test can execute: ``{"if", "then"[, "else"]}``,
    ``{"return"}``, ``{"raise"}``, ``{"let", "value"}``, ``{"call"}``, ``{"try", "except"}``,
    ``{"for", "in"}`` (body not recorded), ``{"def"}``; expressions as normalized source text."""
    out = []
    for s in stmts:
        if isinstance(s, ast.If):
            item = {"if": ast.unparse(s.test), "then": flow(s.body)}
            if s.orelse:
                item["else"] = flow(s.orelse)
            out.append(item)
        elif isinstance(s, ast.Return):
            out.append({"return": ast.unparse(s.value) if s.value is not None else "None"})
        elif isinstance(s, ast.Raise):
            out.append({"raise": ast.unparse(s.exc) if s.exc is not None else ""})
        elif isinstance(s, (ast.Assign, ast.AnnAssign)) and s.value is not None:
            target = s.targets[0] if isinstance(s, ast.Assign) else s.target
            out.append({"let": ast.unparse(target), "value": ast.unparse(s.value)})
        elif isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant):
            continue  # a docstring
        elif isinstance(s, ast.Expr):
            out.append({"call": ast.unparse(s.value)})
        elif isinstance(s, ast.Try):
            out.append({"try": flow(s.body), "except": flow(s.handlers[0].body) if s.handlers else []})
        elif isinstance(s, ast.For):
            out.append({"for": ast.unparse(s.target), "in": ast.unparse(s.iter)})
        elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append({"def": s.name})
        else:
            out.append({"stmt": type(s).__name__})
    return out


def calls_named(node: ast.AST, name: str) -> List[ast.Call]:
    """Every call in ``node`` whose function is ``name`` or ``<something>.name``."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            if (isinstance(f, ast.Name) and f.id == name) or (isinstance(f, ast.Attribute) and f.attr == name):
                out.append(n)
    return out


def if_nodes(node: ast.AST, mentioning: str, *, raising: bool = False) -> List[ast.If]:
    """``if`` statements in ``node`` whose test mentions ``mentioning`` (and, with ``raising``, whose
    body raises), outermost first."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.If) and mentioning in ast.unparse(n.test):
            if not raising or any(isinstance(b, ast.Raise) for b in n.body):
                out.append(n)
    return out
