"""The fastest recompute and offload modules that bring one layout's memory under a budget.

A layout's *setting* is a set of recompute modules (:data:`~folding.model.recompute.RECOMPUTE_MODULES`,
``train.recompute_modules``) with a set of offload modules (:data:`~folding.memory.offload.OFFLOAD_MODULES`,
``train.offload_modules``), or the whole layer recomputed (``train.recompute=full``, no offload). The modes
``none``, ``selective`` and ``moe`` are module sets of their own (``{}``, ``{core_attn}``, ``{moe}``).
:func:`module_space` lists the modules that apply to a model: ``mla_up_proj`` only with multi-head latent
attention, ``mlp`` only with dense layers, ``shared_experts`` only with a shared expert; a setting whose
offload module a recompute module empties (:func:`~folding.model.recompute.offload_conflict`) is not one.

:func:`cheapest_setting` returns, among every setting of that space whose worst-stage peak fits, the one with
the smallest predicted step time (ties: fewer modules, then the names; ``full`` loses every tie). It estimates
few of them (DeepSeek-V3 has 4,801 settings; a search typically estimates 100 to 300), pruning with four
properties of the memory and time models:

- (M) adding a module (recompute or offload) never raises the worst-stage peak;
- (A) offloading never makes a step faster: ``t(R, O) >= t(R, {})``;
- (B) without offload, recomputing one more module never makes a step faster;
- (C) with the recompute set fixed, offloading one more module never makes a step faster.

(Recomputing one more module *can* shorten a step that offloads: its extra forward hides more of the copy; the
search does not rely on that direction.) The search:

1. the plain layout fits: it is the answer (by A and B nothing is faster); what no setting changes
   (parameters, gradients, optimizer state) does not fit: nothing does;
2. the *maximal* settings (no module can be added; ``full`` among them): a setting fits only inside one that
   fits (M), so recompute sets inside none of those are never visited;
3. a first fit, greedily: the modules that free the most bytes per second of step time, each alone, added
   until the setting fits, then each left out again that it fits without;
4. every recompute set ``R`` whose ``t(R, {})`` (by A and B a lower bound of every setting holding ``R``)
   that fit does not beat, from the largest set down; for each, its offload sets best first by step time
   (C), the first that fits being ``R``'s best. A set is not expanded when it with every offload module after
   its last (the most freeing first), or with every one of those not slower alone than the best so far, does
   not fit (M); a setting that holds one that fits, or is held by one that does not, is known without its
   estimate (M);
5. ``full``, when it is faster than that.

It is therefore exact (the brute-force optimum over the whole space) where M, A, B and C hold. They do not
always: offloading on a stage that keeps fewer than two layers in flight adds more prefetch buffer than it
moves (the memory model says that stage's peak rises), and the step's data-parallel exchange is the slowest
stage's, which one more recompute module can turn into a stage holding fewer parameters (the step gets
faster). So each new estimate is checked against those made before, and when two break a premise the search
ranks every setting by step time and takes the first that fits, exact without any premise. A break no two of
its estimates show goes unnoticed; the estimate of every recompute module without offload, made beside the
maximal settings, is there to show the first kind. The answer's own estimate always fits. Tests compare the
search with a brute force on layouts where the premises hold and on one where they break.

Usage::

    space = module_space(cfg)
    fit = cheapest_setting(plan, space, memory_of=lambda p: plan_memory(cfg, p, shape=shape),
                           step_seconds=lambda p: estimate_step_time(cfg, p, ...).step_s,
                           fits=lambda nbytes: gpu.fits(nbytes, usable_gib=60))
    fit.plan.recompute, fit.plan.offload      # "layernorm,mla_up_proj", "expert_fc1"
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
from typing import Callable, Dict, FrozenSet, Optional, Tuple

from folding.model.config import OFFLOAD_MODULES, RECOMPUTE_MODULES, ModelConfig, offload_conflict, recompute_spec

from .memory import MemoryEstimate
from .step_time import Plan

Modules = FrozenSet[str]
Setting = Tuple[Modules, Modules]
"""``(recompute modules, offload modules)``."""

FULL: Setting = (frozenset({"full"}), frozenset())
"""The whole layer recomputed (``train.recompute=full``), as a setting."""


@dataclasses.dataclass(frozen=True)
class ModuleSpace:
    """The modules a search may choose from, each tuple in its table's order."""

    recompute: Tuple[str, ...]
    """Recompute modules that apply to the model."""
    offload: Tuple[str, ...] = OFFLOAD_MODULES
    """Offload modules."""
    full: bool = True
    """Whether ``train.recompute=full`` is a candidate."""


def module_space(cfg: ModelConfig) -> ModuleSpace:
    """The modules that apply to ``cfg``: every recompute module but ``mla_up_proj`` without
    multi-head latent attention, ``mlp`` without a dense layer and ``shared_experts`` without a shared
    expert; every offload module; ``full``."""
    skip = set()
    if cfg.mla is None:
        skip.add("mla_up_proj")
    if all(cfg.is_moe_layer(i) for i in cfg.layer_numbers()):
        skip.add("mlp")
    if not cfg.moe.shared_expert_ffn_hidden_size:
        skip.add("shared_experts")
    return ModuleSpace(recompute=tuple(m for m in RECOMPUTE_MODULES if m not in skip))


def setting_plan(plan: Plan, setting: Setting) -> Plan:
    """``plan`` with ``setting``'s ``recompute`` (the canonical string: a mode's name when it is one) and
    ``offload`` (names in the table's order, joined by commas)."""
    rec, off = setting
    name = "full" if setting == FULL else recompute_spec("none", sorted(rec)).name
    return dataclasses.replace(plan, recompute=name, offload=",".join(m for m in OFFLOAD_MODULES if m in off))


@functools.lru_cache(maxsize=None)
def compatible_offload(space: ModuleSpace, rec: Modules) -> Tuple[str, ...]:
    """The offload modules of ``space`` that the recompute modules ``rec`` leave something to move."""
    rc = recompute_spec("none", sorted(rec))
    return tuple(m for m in space.offload if offload_conflict(rc, [m]) is None)


@functools.lru_cache(maxsize=None)
def maximal_settings(space: ModuleSpace) -> Tuple[Setting, ...]:
    """The settings no module can be added to: each recompute set with every offload module it leaves
    something to move, kept when no added recompute module would leave that offload set possible; ``full``."""
    out = []
    for n in range(len(space.recompute) + 1):
        for rec in map(frozenset, itertools.combinations(space.recompute, n)):
            off = frozenset(compatible_offload(space, rec))
            grows = any(off <= set(compatible_offload(space, rec | {r})) for r in space.recompute if r not in rec)
            if not grows:
                out.append((rec, off))
    return tuple(out + ([FULL] if space.full else []))


@dataclasses.dataclass(frozen=True)
class Fit:
    """The answer of :func:`cheapest_setting`."""

    plan: Plan
    """The plan with the chosen ``recompute`` and ``offload``."""
    step_s: float
    """Its predicted step time."""
    memory: MemoryEstimate
    """Its worst-stage memory (``memory_of``'s)."""
    memory_evaluations: int
    """Settings whose peak the search evaluated."""
    time_evaluations: int
    """Settings whose step time the search evaluated."""


def cheapest_setting(
    plan: Plan,
    space: ModuleSpace,
    *,
    memory_of: Callable[[Plan], MemoryEstimate],
    step_seconds: Callable[[Plan], float],
    fits: Callable[[float], bool],
    bound_s: Optional[float] = None,
) -> Optional[Fit]:
    """The fastest setting of ``space`` for ``plan``'s layout whose worst-stage peak ``memory_of(p).total``
    ``fits`` (see the module docstring for the search and what makes it exact); ``None`` when none fits, or,
    with ``bound_s``, when none that fits is as fast as ``bound_s`` seconds (settings slower than it are not
    searched). ``plan``'s own ``recompute`` and ``offload`` are ignored. What no setting changes (a
    :class:`~folding.planning.memory.MemoryEstimate`'s total less its ``activations`` and ``transient``:
    parameters, gradients, optimizer state) is a floor of every setting's peak."""
    return _Search(plan, space, memory_of, step_seconds, fits, bound_s).run()


class _Search:
    """One search's caches and incumbent (state of one call, discarded with it)."""

    def __init__(self, plan, space, memory_of, step_seconds, fits, bound_s):
        self.plan, self.space, self.fits, self.bound_s = plan, space, fits, bound_s
        self._memory, self._seconds = memory_of, step_seconds
        self.mem: Dict[Setting, MemoryEstimate] = {}
        self.sec: Dict[Setting, float] = {}
        self.best: Optional[Tuple[tuple, Setting]] = None  # (key, setting)
        self.roomy: list = []  # the recompute sets of the maximal settings that fit
        self.offload_order = space.offload  # the order of the offload tree
        self.fitting: list = []  # settings evaluated that fit
        self.over: list = []  # settings evaluated that do not
        self.checked = True  # whether each new estimate is checked against the premises

    def peak(self, s: Setting) -> float:
        """``s``'s worst-stage peak; :class:`_Broken` when it and a setting evaluated before break (M)."""
        if s not in self.mem:
            self.mem[s] = self._memory(setting_plan(self.plan, s))
            if self.checked and s != FULL:
                v = self.mem[s].total
                for t, e in self.mem.items():
                    if t != FULL and (_holds(s, t) and v > e.total or _holds(t, s) and v < e.total):
                        raise _Broken
        return self.mem[s].total

    def fit(self, s: Setting) -> bool:
        """Whether ``s`` fits; known without evaluating it when it holds a setting that fits or is held by
        one that does not (M)."""
        if s not in self.mem and s != FULL:
            if any(s[0] >= f[0] and s[1] >= f[1] for f in self.fitting):
                return True
            if any(s[0] <= n[0] and s[1] <= n[1] for n in self.over):
                return False
        ok = self.fits(self.peak(s))
        if s != FULL:
            (self.fitting if ok else self.over).append(s)
        return ok

    def seconds(self, s: Setting) -> float:
        """``s``'s step time; :class:`_Broken` when it and a setting timed before break (A), (B) or (C)."""
        if s not in self.sec:
            self.sec[s] = self._seconds(setting_plan(self.plan, s))
            if self.checked and s != FULL:
                v = self.sec[s]
                for t, e in self.sec.items():
                    if t != FULL and (_ordered(s, t) and v < e or _ordered(t, s) and v > e):
                        raise _Broken
        return self.sec[s]

    def rank(self, s: Setting) -> tuple:
        """What breaks a tie of step time: module count (``full`` after any set), then the names."""
        if s == FULL:
            return (len(self.space.recompute) + len(self.space.offload) + 1, "full", "")
        rec, off = s
        return (len(rec) + len(off), ",".join(sorted(rec)), ",".join(sorted(off)))

    def key(self, s: Setting) -> tuple:
        """The order settings are ranked by: step time, then :meth:`rank`."""
        return (self.seconds(s), *self.rank(s))

    def beaten(self, bound: tuple) -> bool:
        """Whether nothing whose time and module count are at least ``bound``'s can improve the answer."""
        if self.bound_s is not None and bound[0] > self.bound_s:
            return True
        return self.best is not None and bound[:2] > self.best[0][:2]

    def offer(self, s: Setting) -> None:
        """Take ``s`` (which fits) as the answer if it ranks first so far (and is within ``bound_s``)."""
        if self.bound_s is not None and self.seconds(s) > self.bound_s:
            return
        if self.best is None or self.key(s) < self.best[0]:
            self.best = (self.key(s), s)

    def run(self) -> Optional[Fit]:
        try:
            self._search()
        except _Broken:  # the pruning's premises do not hold here: every setting by rank, the first that fits
            self.checked, self.best = False, None
            for s in sorted(all_settings(self.space), key=self.key):
                if self.bound_s is not None and self.seconds(s) > self.bound_s:
                    break
                if self.fits(self.peak(s)):
                    self.offer(s)
                    break
        if self.best is None:
            return None
        s = self.best[1]
        return Fit(setting_plan(self.plan, s), self.seconds(s), self.mem[s], len(self.mem), len(self.sec))

    def _search(self) -> None:
        empty: Setting = (frozenset(), frozenset())
        if self.beaten(self.key(empty)):
            return
        floor = self.peak(empty) - self.mem[empty].activations - self.mem[empty].transient
        if self.fit(empty):
            self.offer(empty)
        elif self.fits(floor):
            # by (M) a setting fits only inside a maximal one that fits
            self.roomy = [s[0] for s in maximal_settings(self.space) if s != FULL and self.fit(s)]
            # offloading raises a peak where its prefetch buffer outweighs what it moves (a stage with under two
            # layers in flight): every recompute module without offload, beside the maximal settings, shows it
            self.peak((frozenset(self.space.recompute), frozenset()))
            # the offload modules that free the most come first in the tree: a set of small ones is then
            # followed only by small ones, and dropped as soon as all of them together do not fit (M)
            nothing = frozenset()
            self.offload_order = sorted(self.space.offload, key=lambda o: self.peak((nothing, frozenset([o]))))
            if self.roomy:
                self._dive()
                self._recompute_sets()
            if self.space.full and self.fit(FULL) and not self.beaten(self.key(FULL)):
                self.offer(FULL)
        if self.best is not None and not self.fits(self.peak(self.best[1])):
            raise _Broken  # it holds one that fits (M says it fits too)

    def _dive(self) -> None:
        """A first fit to prune with: add the modules that free the most per second of step time each alone,
        one by one, until the setting fits; then leave out again each one it fits without."""
        empty: Setting = (frozenset(), frozenset())
        t0, base = self.seconds(empty), self.peak(empty)

        def alone(m: str) -> Setting:
            return (frozenset([m]), frozenset()) if m in self.space.recompute else (frozenset(), frozenset([m]))

        def rate(m: str) -> float:  # bytes freed per second added
            return (base - self.peak(alone(m))) / max(self.seconds(alone(m)) - t0, 1e-9 * t0)

        modules = [m for m in (*self.space.recompute, *self.space.offload) if self.peak(alone(m)) < base]
        modules.sort(key=rate, reverse=True)
        s = empty
        for m in modules:
            trial = (s[0] | alone(m)[0], s[1] | alone(m)[1])
            if _valid(trial):
                s = trial
                if self.fit(s):
                    break
        else:
            return
        for m in reversed(modules):  # the dearest first
            trial = (s[0] - {m}, s[1] - {m})
            if trial != s and _valid(trial) and self.fit(trial):
                s = trial
        self.offer(s)

    def _recompute_sets(self) -> None:
        """Every recompute set whose bound ``t(R, {})`` the first fit does not beat (they hold each other's
        subsets, B), searched from the largest down: what does not fit with a large set does not with its
        subsets (M), which are then mostly known without an estimate."""
        todo, frontier = [], [frozenset()]
        while frontier:
            rec = frontier.pop()
            if not self.beaten(self.key((rec, frozenset()))):
                todo.append(rec)
                frontier.extend(self._recompute_children(rec))
        for rec in sorted(todo, key=lambda r: (-len(r), self.key((r, frozenset())))):
            if not self.beaten(self.key((rec, frozenset()))):
                self._visit_recompute(rec)

    def _recompute_children(self, rec: Modules):
        """``rec`` and one recompute module after its last, when a maximal setting that fits holds it (M)."""
        last = max((self.space.recompute.index(m) for m in rec), default=-1)
        for m in self.space.recompute[last + 1 :]:
            if any(rec | {m} <= r for r in self.roomy):
                yield rec | {m}

    def _visit_recompute(self, rec: Modules) -> None:
        """The offload sets of ``rec`` best first by step time (C): the first that fits is ``rec``'s best. A
        set's children (one offload module after its last) wait under its time, a lower bound of theirs (C);
        a child's own time is evaluated when it comes first and fits. A set is not expanded when it with every
        module after its last, or every one of those not beaten alone, does not fit (M)."""
        allowed = tuple(m for m in self.offload_order if m in compatible_offload(self.space, rec))

        def later(off: Modules) -> Tuple[str, ...]:
            return allowed[max((allowed.index(m) for m in off), default=-1) + 1 :]

        def expand(off: Modules) -> bool:
            rest = later(off)
            if not rest or not self.fit((rec, off | set(rest))):
                return False
            known = [self.sec.get((rec, frozenset([m]))) for m in rest]
            useful = [m for m, t in zip(rest, known) if t is None or not self.beaten((t, len(rec) + len(off) + 1))]
            return bool(useful) and (len(useful) == len(rest) or self.fit((rec, off | set(useful))))

        heap = [(self.key((rec, frozenset())), True, frozenset())]
        while heap:
            k, exact, off = heapq.heappop(heap)
            if self.beaten(k):
                return
            if self.fit((rec, off)):
                if exact:
                    self.offer((rec, off))
                    return
                heapq.heappush(heap, (self.key((rec, off)), True, off))
            elif expand(off):
                for m in later(off):
                    heapq.heappush(heap, ((k[0], *self.rank((rec, off | {m}))), False, off | {m}))


class _Broken(Exception):
    """Two settings the search evaluated break (M), (A), (B) or (C)."""


def _holds(big: Setting, small: Setting) -> bool:
    """Whether ``big`` holds every module of ``small``."""
    return big[0] >= small[0] and big[1] >= small[1]


def _ordered(big: Setting, small: Setting) -> bool:
    """Whether (A), (B) or (C) says ``big`` is no faster than ``small``: the same recompute set and more offload
    modules, or no offload module and more recompute modules."""
    if big[0] == small[0]:
        return big[1] >= small[1]
    return not big[1] and not small[1] and big[0] >= small[0]


def all_settings(space: ModuleSpace) -> Tuple[Setting, ...]:
    """Every setting of ``space``: each recompute set with each offload set none of whose modules it empties,
    then ``full``."""
    out = []
    for n in range(len(space.recompute) + 1):
        for rec in map(frozenset, itertools.combinations(space.recompute, n)):
            allowed = compatible_offload(space, rec)
            for k in range(len(allowed) + 1):
                out += [(rec, frozenset(off)) for off in itertools.combinations(allowed, k)]
    return tuple(out + ([FULL] if space.full else []))


def _valid(s: Setting) -> bool:
    """Whether no recompute module of ``s`` empties one of its offload modules."""
    return offload_conflict(recompute_spec("none", sorted(s[0])), s[1]) is None
