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
