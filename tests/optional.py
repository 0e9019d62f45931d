"""Optional test oracles: a missing one skips its tests on a developer's machine and fails them in CI.

Some tests compare the engine against independent implementations that come with the ``dev`` extras
(``pip install -e .[dev]``): transformers (Hugging Face parity, conversion, export) and megatron-core
(routing helpers, the dispatcher adapter). Without them those tests skip locally; with the
environment variable ``CI=true`` (what CI services set) a missing oracle is a broken install, and the
tests fail instead, so a run of silent skips never passes for a green suite. The engine's own modules
are never optional: :func:`require` refuses ``folding`` names, and a test imports them plainly (an
``ImportError`` of ``folding`` fails everywhere).

Usage::

    from tests.optional import require

    transformers = require("transformers")          # at module level or inside a test
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Optional

import pytest


def under_ci() -> bool:
    """Whether the environment variable ``CI`` is ``true`` (any case)."""
    return os.environ.get("CI", "").strip().lower() == "true"


def require(module: str, reason: Optional[str] = None) -> ModuleType:
    """Import and return the optional oracle ``module``. When it does not import: skip the test (or the
    whole module, at module level) with ``reason``; under ``CI=true`` fail, naming the extras to install."""
    if module.split(".")[0] == "folding":
        raise ValueError(f"{module} is part of the engine, never optional: import it plainly")
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if under_ci():
            pytest.fail(
                f"CI=true and the test oracle {module} does not import ({type(exc).__name__}: {exc}); "
                "install the dev extras: pip install -e .[dev]",
                pytrace=False,
            )
        pytest.skip(
            reason or f"{module} is not installed (optional test oracle, the dev extras)", allow_module_level=True
        )
