"""The overlap runtime (``folding.overlap.runtime``): its state is one object, not module globals, and
every thread that runs a piece of a step reaches it.

The autograd engine runs a CUDA backward on its own device thread, whose context holds no current
runtime; here a plain thread stands in for it (on CPU the engine runs the backward on the caller's
thread, which would hide a missing hand-on)."""

import __future__

import ast
import contextvars
import importlib
import os
import pkgutil
import threading
import types

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import folding.overlap
from folding.overlap import wgrad
from folding.overlap.exchange import Exchange, ExchangeObserver
from folding.overlap.runtime import OverlapRuntime, current_runtime, defer, recompute_contexts

IMMUTABLE = (str, bytes, int, float, bool, type(None), frozenset, contextvars.ContextVar, __future__._Feature)


def _immutable(value) -> bool:
    if isinstance(value, tuple):
        return all(_immutable(v) for v in value)
    if isinstance(value, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType)):
        return True
    return isinstance(value, IMMUTABLE) or type(value).__module__ == "typing"


def _modules():
    path = folding.overlap.__path__
    return ["folding.overlap"] + [f"folding.overlap.{m.name}" for m in pkgutil.iter_modules(path)]


@pytest.mark.parametrize("name", _modules())
def test_no_module_level_mutable_state(name):
    module = importlib.import_module(name)
    mutable = {k: type(v).__name__ for k, v in vars(module).items() if not k.startswith("__") and not _immutable(v)}
    assert not mutable, f"{name} keeps state at module level: {mutable}"
    source = open(module.__file__, encoding="utf-8").read()
    rebinds = [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Global)]
    assert not rebinds, f"{name} rebinds module globals (global statement at lines {rebinds})"


def test_the_package_holds_the_five_concepts():
    here = os.path.dirname(folding.overlap.__file__)
    assert {"lanes.py", "deferred.py", "exchange.py", "wgrad.py", "runtime.py"} <= set(os.listdir(here))


class _Count(ExchangeObserver):
    def __init__(self):
        self.issued_what = []

    def issued(self, ex):
        self.issued_what.append(ex.what)


def test_two_runtimes_share_nothing():
    a, b = OverlapRuntime(), OverlapRuntime()
    seen_a, seen_b = _Count(), _Count()
    with a.observe(seen_a), b.observe(seen_b):
        with a.active():
            work = defer(lambda: "ran")
        with b.active():
            Exchange([], what="on b").wait()  # b's wait runs b's work only
            assert a.deferred.pending() == 1
        with a.active():
            Exchange([], what="on a").wait()
        assert a.deferred.pending() == 0 and work.result() == "ran"
    assert (seen_a.issued_what, seen_b.issued_what) == (["on a"], ["on b"])
    assert current_runtime() is None


def test_outside_every_runtime_work_runs_at_once_and_a_wait_only_waits():
    assert current_runtime() is None
    ran = []
    d = defer(lambda: ran.append(1) or "done")
    assert ran == [1] and d.result() == "done"
    ex = Exchange([], what="alone")
    ex.wait()
    assert ex.runtime is None and not ex.paired


def test_the_helper_lane_runs_under_the_pairs_runtime():
    rt = OverlapRuntime()
    with rt, rt.active():
        _, seen = rt.run_pair(lambda: Exchange([], what="a").wait(), current_runtime)
        assert seen is rt and rt.stats.pairs == 1
        assert rt.lane_thread() is not threading.current_thread()


def _in_a_thread_with_an_empty_context(fn):
    """Run ``fn`` on a new thread (its context holds no runtime, like the engine's device thread)."""
    errors = []

    def run():
        try:
            assert current_runtime() is None
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def test_a_backward_on_another_thread_defers_onto_its_forwards_runtime():
    rt = OverlapRuntime()
    w = torch.nn.Parameter(torch.randn(6, 4))
    x = torch.randn(3, 4, requires_grad=True)
    with rt.active():
        h = wgrad.linear(x, w)
    pending = []
    x.register_hook(lambda g: pending.append(rt.deferred.pending()))
    _in_a_thread_with_an_empty_context(lambda: (h * h).sum().backward())
    assert pending == [1]  # the weight gradient waited on the runtime's queue (not run at once)...
    assert rt.deferred.pending() == 0 and w.grad is not None  # ...until the end-of-backward flush


@pytest.mark.parametrize("context", [True, False])
def test_a_recompute_on_another_thread_reenters_the_forwards_runtime(context):
    rt, seen = OverlapRuntime(), _Count()

    def region(x):
        Exchange([], what="inside").wait()
        return (x * 2).sin()

    kw = dict(context_fn=recompute_contexts) if context else {}
    x = torch.randn(4, requires_grad=True)
    with rt.observe(seen):
        with rt.active():
            y = checkpoint(region, x, use_reentrant=False, **kw)
        _in_a_thread_with_an_empty_context(lambda: y.sum().backward())
    # the forward's exchange, and the recompute's only when it re-entered the runtime
    assert seen.issued_what == (["inside", "inside"] if context else ["inside"])


INSTRUMENT_PARAMETERS = {"linked", "link_bytes", "link", "ep", "marks", "steady"}
"""The link model's hooks that the wire's exchange path once took: instruments read the exchange record."""


def test_the_wire_and_the_dispatchers_take_no_instrument_parameter():
    here = os.path.join(os.path.dirname(os.path.dirname(folding.overlap.__file__)), "moe", "dispatch")
    found = []
    for f in sorted(os.listdir(here)):
        if f.endswith(".py"):
            tree = ast.parse(open(os.path.join(here, f), encoding="utf-8").read())
            for fn in ast.walk(tree):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = fn.args
                    names = {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs}
                    found += [f"{f}:{fn.name}({n})" for n in sorted(names & INSTRUMENT_PARAMETERS)]
    assert len(os.listdir(here)) > 5 and not found, found
