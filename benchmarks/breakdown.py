"""Where a training step's time goes: a PyTorch-profiler breakdown by part of the model.

Forward: every labelled module (or method) runs inside a ``torch.profiler.record_function`` range
named ``part:<category>``; the range's CPU time is that part's forward time. Backward: each autograd
node carries the ``sequence_nr`` of the forward op that created it, so every
``autograd::engine::evaluate_function`` event is charged to the category whose forward range held
the op with that ``sequence_nr``. The optimizer is the ``Optimizer.step`` range. Whatever is left of
the step's wall time (embedding, norms, output layer, residual adds, Python) is ``other``.

Usage::

    labels = Labeller()
    labels.modules(model, {"attention": (Attention,), "router": (Router,), "experts": (GroupedMLP,)})
    labels.method(layer.dispatcher, "dispatch", "dispatch")
    with torch.profiler.profile() as prof:
        t0 = time.perf_counter(); step(); wall = time.perf_counter() - t0
    parts = breakdown(prof, wall)          # {"attention": seconds, ..., "other": seconds}
"""

from __future__ import annotations

import functools
from typing import Dict, List, Tuple

import torch
from torch.autograd.profiler import record_function

PREFIX = "part:"
CATEGORIES = ("attention", "router", "dispatch", "experts", "combine", "loss", "optimizer")
"""Categories of the report, in order (``other`` is added last)."""


class Labeller:
    """Wraps modules and methods so that their forward runs in a ``part:<category>`` profiler range."""

    def __init__(self):
        self._handles: List = []

    def modules(self, model: torch.nn.Module, by_class: Dict[str, Tuple[type, ...]]) -> int:
        """Label every submodule of ``model`` that is an instance of a class listed for a category.

        Returns the number of modules labelled (a zero means the classes did not match the model).
        """
        n = 0
        for m in model.modules():
            for cat, classes in by_class.items():
                if isinstance(m, classes):
                    self._label_module(m, cat)
                    n += 1
                    break
        return n

    def _label_module(self, m: torch.nn.Module, cat: str) -> None:
        stack: List = []

        def pre(_mod, _args):
            rf = record_function(PREFIX + cat)
            rf.__enter__()
            stack.append(rf)

        def post(_mod, _args, _out):
            stack.pop().__exit__(None, None, None)

        self._handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]

    def method(self, obj, name: str, cat: str) -> None:
        """Run ``obj.name(...)`` inside a ``part:<cat>`` range (an instance attribute shadows the method)."""
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def wrapped(*a, **k):
            with record_function(PREFIX + cat):
                return fn(*a, **k)

        setattr(obj, name, wrapped)


def breakdown(prof, wall_s: float, backward_nodes: Dict[str, int] = None) -> Dict[str, float]:
    """Seconds per category (forward + backward; ``optimizer``; ``other`` = wall minus the rest).

    ``backward_nodes``, when given, receives the number of autograd nodes charged to each category.
    """
    events = list(prof.events())
    ranges = [
        (e.name[len(PREFIX) :], e.thread, e.time_range.start, e.time_range.end, e.cpu_time_total)
        for e in events
        if e.name.startswith(PREFIX)
    ]
    out = {c: 0.0 for c in CATEGORIES}
    for cat, _thr, _s, _e, total in ranges:
        # a range nested in another range of the same category (a module calling itself) would count twice;
        # labelled modules here are leaves, so ranges do not nest.
        out[cat] += total * 1e-6
    seq_cat: Dict[int, str] = {}
    by_thread: Dict[int, list] = {}
    for r in ranges:
        by_thread.setdefault(r[1], []).append(r)
    for e in events:
        if e.sequence_nr is None or e.sequence_nr < 0 or e.name.startswith(("autograd::", PREFIX)):
            continue
        for cat, _thr, s, end, _t in by_thread.get(e.thread, ()):
            if s <= e.time_range.start and e.time_range.end <= end:
                seq_cat.setdefault(e.sequence_nr, cat)
                break
    for e in events:
        if e.name.startswith("autograd::engine::evaluate_function") and e.sequence_nr in seq_cat:
            out[seq_cat[e.sequence_nr]] += e.cpu_time_total * 1e-6
            if backward_nodes is not None:
                cat = seq_cat[e.sequence_nr]
                backward_nodes[cat] = backward_nodes.get(cat, 0) + 1
        elif e.name.startswith("Optimizer.step"):
            out["optimizer"] += e.cpu_time_total * 1e-6
    out["other"] = max(0.0, wall_s - sum(out.values()))
    return out


def format_breakdown(rows: Dict[str, Dict[str, float]]) -> str:
    """Markdown table: one column per model (``rows[model][category]`` seconds), ms and % of the step."""
    names = list(rows)
    cats = list(CATEGORIES) + ["other"]
    lines = ["| part | " + " | ".join(f"{n} ms | {n} %" for n in names) + " |", "|---|" + "---|---|" * len(names)]
    for c in cats:
        cells = []
        for n in names:
            tot = sum(rows[n].values()) or 1.0
            cells += [f"{rows[n].get(c, 0.0) * 1e3:.0f}", f"{100 * rows[n].get(c, 0.0) / tot:.1f}"]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


GEMM_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::_grouped_mm", "aten::baddbmm")


def op_classes(prof, wall_s: float) -> Dict[str, float]:
    """Seconds by kind of work: GEMMs (self time of matmul kernels), attention kernels (SDPA forward and
    backward), the optimizer (``Optimizer.step`` and ``zero_grad``), and the rest of the step."""
    out = {"gemm": 0.0, "attention kernels": 0.0, "optimizer": 0.0}
    for e in prof.key_averages():
        if e.key in GEMM_OPS:
            out["gemm"] += e.self_cpu_time_total * 1e-6
        elif "scaled_dot_product" in e.key:
            out["attention kernels"] += e.self_cpu_time_total * 1e-6
        elif e.key.startswith(("Optimizer.step", "Optimizer.zero_grad")):
            out["optimizer"] += e.cpu_time_total * 1e-6
    out["rest"] = max(0.0, wall_s - sum(out.values()))
    return out
