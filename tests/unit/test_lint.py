"""The tree is ruff-clean (lint rules and format, configured in pyproject.toml): the test suite, and
so CI, fails on a violation. Fix with ``ruff check --fix . && ruff format .``."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ruff(*args):
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check_is_clean():
    r = _ruff("check", "--output-format", "concise", ".")
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]


def test_ruff_format_is_clean():
    r = _ruff("format", "--check", ".")
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]


def test_docs_and_code_cite_only_the_repository():
    # every fact the code relies on lives in the project's own docs: no citation of files it lacks
    outside = ("REFERENCE" + ".md", "../" + "shared/")
    hits = []
    for root, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("outputs", "multirun", "__pycache__")]
        for f in files:
            if f.endswith((".py", ".md", ".yaml", ".sbatch")):
                path = os.path.join(root, f)
                text = open(path, encoding="utf-8", errors="replace").read()
                hits += [f"{os.path.relpath(path, ROOT)}: {o}" for o in outside if o in text]
    assert not hits, hits
