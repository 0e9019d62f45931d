"""``tests/optional.py``: a missing test oracle skips locally and fails under ``CI=true``; the engine's
own modules are never optional; and no test file skips on an import by any other route."""

import ast
import os

import pytest

from tests.optional import require, under_ci

MISSING = "folding_test_oracle_that_is_not_installed"
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_missing_oracle_skips_without_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert not under_ci()
    with pytest.raises(pytest.skip.Exception, match="not installed"):
        require(MISSING)
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="the reason given"):
        require(MISSING, reason="the reason given")


@pytest.mark.parametrize("value", ["true", "True", "TRUE"])
def test_missing_oracle_fails_under_ci(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    assert under_ci()
    with pytest.raises(pytest.fail.Exception, match=rf"CI=true and the test oracle {MISSING} does not import.*\[dev\]"):
        require(MISSING)


@pytest.mark.parametrize("ci", ["true", None])
def test_present_module_is_returned_either_way(monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    assert require("json").dumps([1]) == "[1]"


def test_the_engine_is_never_optional():
    with pytest.raises(ValueError, match="never optional"):
        require("folding.moe.layer")


def test_no_test_turns_an_import_into_a_skip_by_another_route():
    # pytest.importorskip, or a skip inside an `except ImportError` handler, would bypass CI=true
    bad = []
    for root, _, files in os.walk(TESTS):
        for f in files:
            if not f.endswith(".py") or f == "optional.py":
                continue
            path = os.path.join(root, f)
            tree = ast.parse(open(path, encoding="utf-8").read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr == "importorskip":
                    bad.append(f"{path}:{node.lineno} importorskip")
                if isinstance(node, ast.ExceptHandler) and node.type is not None:
                    names = {n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)}
                    skips = [n for n in ast.walk(node) if isinstance(n, ast.Attribute) and n.attr == "skip"]
                    if names & {"ImportError", "ModuleNotFoundError"} and skips:
                        bad.append(f"{path}:{node.lineno} skip on ImportError")
    assert not bad, bad
