"""The embedded default corpus: real English text and code that needs no download.

``folding/data/corpus/stdlib_docs.jsonl.gz`` ships with the package: the docstring of every module of the
CPython 3.11 standard library and the signatures and docstrings of its public classes, functions and
methods, in source order, one JSON line per run of about 1000 characters of one module. It was produced by
:func:`generate_stdlib_corpus` (reading the sources with ``ast``, importing nothing) and is shipped,
not regenerated, so that every machine trains on the same bytes whatever its Python version. The
text is part of CPython and is distributed under the PSF License Agreement, whose text is
``folding/data/corpus/LICENSE-PSF.txt``.

:func:`default_corpus_prefix` tokenizes it on first use with the configured tokenizer into
``<cache_dir>/corpus-<tokenizer fingerprint>/stdlib_docs.{bin,idx}`` (EOD after every document),
built once when N ranks start at once and published by an atomic rename.

Usage::

    prefix = default_corpus_prefix("byte", cache_dir)   # -> a prefix for IndexedDataset
    generate_stdlib_corpus("out.jsonl.gz")              # regenerate from the running Python
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import sysconfig
from typing import List, Optional

from .cache import build_once, default_cache_dir
from .preprocess import preprocess_jsonl
from .tokenizer import build_tokenizer

CORPUS_FILE = os.path.join(os.path.dirname(__file__), "corpus", "stdlib_docs.jsonl.gz")
"""Path of the shipped corpus (JSON lines, gzip, key ``text``)."""
_SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "tkinter",
    "turtledemo",
    "site-packages",
    "ensurepip",
    "pydoc_data",
    "__pycache__",
    "config-3.11-x86_64-linux-gnu",
}


def _module_entries(name: str, source: str) -> List[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    out = []
    doc = ast.get_docstring(tree)
    if doc:
        out.append(f"Module {name}\n\n{doc.strip()}\n")

    def visit(node, prefix):
        for child in node.body:
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if child.name.startswith("_") and child.name != "__init__":
                    continue
                d = ast.get_docstring(child)
                if isinstance(child, ast.ClassDef):
                    bases = ", ".join(ast.unparse(b) for b in child.bases)
                    head = f"class {prefix}{child.name}({bases})" if bases else f"class {prefix}{child.name}"
                    if d:
                        out.append(f"{head}:\n{d.strip()}\n")
                    visit(child, prefix + child.name + ".")
                elif d:
                    out.append(f"def {prefix}{child.name}({ast.unparse(child.args)}):\n{d.strip()}\n")

    visit(tree, "")
    return out


def generate_stdlib_corpus(out_path: str, max_bytes: int = 4_500_000, doc_bytes: int = 1000) -> int:
    """Write the corpus (gzip JSON lines) from the running Python's standard library; returns documents.

    Modules are visited in sorted path order, tests and GUI packages skipped, until ``max_bytes`` of
    text. A module's entries are grouped into documents of about ``doc_bytes`` characters. The result
    depends on the Python version, which is why the package ships a fixed copy.
    """
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS and not x.startswith("config-"))
        paths += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    total = docs = 0
    with gzip.GzipFile(out_path, "wb", mtime=0) as gz:
        for path in sorted(paths):
            name = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            with open(path, encoding="utf-8", errors="replace") as f:
                entries = _module_entries(name, f.read())
            # one document per run of consecutive entries of about doc_bytes (headed by the module name)
            chunks, cur = [], []
            for entry in entries:
                cur.append(entry)
                if sum(map(len, cur)) >= doc_bytes:
                    chunks.append(cur)
                    cur = []
            if cur:
                chunks.append(cur)
            for part, chunk in enumerate(chunks):
                text = "\n".join(chunk)
                if part:
                    text = f"Module {name} (continued)\n\n{text}"
                if len(text) < 200:
                    continue
                line = json.dumps({"text": text, "module": name}, ensure_ascii=False) + "\n"
                gz.write(line.encode("utf-8"))
                total += len(text.encode("utf-8"))
                docs += 1
            if total >= max_bytes:
                break
    return docs


def default_corpus_prefix(tokenizer: str = "byte", cache_dir: Optional[str] = None) -> str:
    """Prefix of the embedded corpus tokenized with ``tokenizer``, building it in ``cache_dir`` once."""
    if not os.path.isfile(CORPUS_FILE):
        raise FileNotFoundError(
            f"the embedded corpus {CORPUS_FILE} is missing from the installation; "
            f"reinstall folding or set data.paths to your own datasets"
        )
    tok = build_tokenizer(tokenizer)
    cache_dir = cache_dir or default_cache_dir()
    final = os.path.join(cache_dir, f"corpus-{tok.fingerprint}")

    def build(tmp):
        preprocess_jsonl(CORPUS_FILE, os.path.join(tmp, "stdlib_docs"), tokenizer=tokenizer, append_eod=True)

    return os.path.join(build_once(final, build), "stdlib_docs")
