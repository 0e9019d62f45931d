"""The fastest recompute and offload modules that fit (:mod:`folding.planning.memory_fit`), checked against
an oracle that evaluates every setting: on a few layouts of two tiny models (DeepSeek-V3's, with every module
that applies: MLA, dense layers, a shared expert; Mixtral's) and budgets from the smallest peak to the largest,
the search returns the oracle's choice; ``None`` when nothing fits; no module when the plain layout fits. The
search's premises (M, A, B, C) hold on the first layouts, and on the last one (one layer per stage) an offload
raises the peak, which the search notices and answers by ranking every setting."""

import functools
import itertools

import pytest

from folding.model.config import OFFLOAD_MODULES, offload_conflict, recompute_spec
from folding.model.presets import get_preset
from folding.planning.hardware import get_gpu
from folding.planning.memory_fit import FULL, ModuleSpace, cheapest_setting, module_space, setting_plan
from folding.planning.planner import COMPUTE_EFFICIENCY, enumerate_plans, plan_memory
from folding.planning.step_time import Cluster, TrainingShape, estimate_step_time

CLUSTER = Cluster(gpu=get_gpu("h100"), num_gpus=8)
SHAPE = TrainingShape(seq_length=256, global_batch_size=16)
LAYOUTS = {  # (model, tp, cp, pp, ep, etp)
    "deepseek_v3_tiny pp2": ("deepseek_v3_tiny", 1, 1, 2, 4, 1),
    "mixtral_tiny pp2 cp2": ("mixtral_tiny", 1, 2, 2, 2, 1),
    "mixtral_tiny pp4": ("mixtral_tiny", 2, 1, 4, 2, 1),  # one layer per stage: offloading can raise the peak
}


def _plan(name):
    model, *sizes = LAYOUTS[name]
    cfg = get_preset(model)
    plans = enumerate_plans(cfg, cluster=CLUSTER, shape=SHAPE)
    return cfg, next(
        p
        for p in plans
        if [p.tp, p.cp, p.pp, p.ep, p.etp] == sizes and p.vpp == 1 and p.distributed_optimizer and p.recompute == "none"
    )


def _seconds(cfg, p):
    return estimate_step_time(cfg, p, shape=SHAPE, cluster=CLUSTER, compute_efficiency=COMPUTE_EFFICIENCY).step_s


@functools.lru_cache(maxsize=None)
def _table(name):
    """``{(recompute modules, offload modules): (peak bytes, step seconds)}`` of every setting: each subset of
    the recompute modules that apply with each subset of the offload modules none of whose tensors it drops,
    and ``full``."""
    cfg, plan = _plan(name)
    space = module_space(cfg)
    settings = [FULL]
    for r in range(len(space.recompute) + 1):
        for rec in itertools.combinations(space.recompute, r):
            for o in range(len(OFFLOAD_MODULES) + 1):
                for off in itertools.combinations(OFFLOAD_MODULES, o):
                    if offload_conflict(recompute_spec("none", rec), off) is None:
                        settings.append((frozenset(rec), frozenset(off)))
    out = {}
    for s in settings:
        p = setting_plan(plan, s)
        out[s] = (plan_memory(cfg, p, shape=SHAPE).total, _seconds(cfg, p))
    return out


def _oracle(name, budget):
    """The setting the search must return: the fastest that fits; ties to fewer modules (``full`` last), then
    the names."""
    table = _table(name)

    def key(s):
        if s == FULL:
            return (table[s][1], 99, "full", "")
        return (table[s][1], len(s[0]) + len(s[1]), ",".join(sorted(s[0])), ",".join(sorted(s[1])))

    fitting = [s for s in table if table[s][0] <= budget]
    return min(fitting, key=key) if fitting else None


def _search(name, budget, **kw):
    cfg, plan = _plan(name)
    return cheapest_setting(
        plan,
        module_space(cfg),
        memory_of=lambda p: plan_memory(cfg, p, shape=SHAPE),
        step_seconds=lambda p: _seconds(cfg, p),
        fits=lambda nbytes: nbytes <= budget,
        **kw,
    )


def test_module_space_has_the_modules_that_apply():
    assert module_space(get_preset("deepseek_v3")).recompute == (
        "core_attn",
        "layernorm",
        "moe_act",
        "mla_up_proj",  # MLA
        "mlp",  # three dense layers
        "moe",
        "shared_experts",  # one shared expert
    )
    assert module_space(get_preset("mixtral_8x22b")) == ModuleSpace(
        recompute=("core_attn", "layernorm", "moe_act", "moe"), offload=OFFLOAD_MODULES, full=True
    )
    assert "shared_experts" in module_space(get_preset("qwen2_57b_a14b")).recompute


def test_premises_hold_on_the_first_layouts_and_break_on_one_layer_stages():
    """(M) a module never raises the peak; (A) offloading never speeds a step up; (B) nor does recomputing
    without offload; (C) nor one more offload module: on the first layouts. On one layer per stage, offloading
    moves one layer and keeps two layers' worth to prefetch: the last stage's peak rises."""

    def broken(name):
        table, out = _table(name), set()
        for (rec, off), (mem, sec) in table.items():
            if (rec, off) == FULL:
                continue
            for more in [(rec | {m}, off) for m in module_space(_plan(name)[0]).recompute] + [
                (rec, off | {m}) for m in OFFLOAD_MODULES
            ]:
                if more in table and more != (rec, off):
                    out |= {"M"} if table[more][0] > mem else set()
                    if more[0] == rec:
                        out |= {"C"} if table[more][1] < sec else set()
                    elif not off:
                        out |= {"B"} if table[more][1] < sec else set()
            out |= {"A"} if sec < table[(rec, frozenset())][1] else set()
        return out

    assert broken("deepseek_v3_tiny pp2") == set()
    assert broken("mixtral_tiny pp2 cp2") == set()
    assert broken("mixtral_tiny pp4") == {"M"}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_search_returns_the_oracles_setting(name):
    peaks = sorted({mem for mem, _ in _table(name).values()})
    budgets = [peaks[0] - 1, peaks[-1]] + [peaks[int(f * (len(peaks) - 1))] for f in (0, 0.01, 0.05, 0.2, 0.5, 0.8)]
    budgets += [(a + b) / 2 for a, b in zip(peaks[:: max(1, len(peaks) // 6)], peaks[1 :: max(1, len(peaks) // 6)])]
    chosen = set()
    for budget in budgets:
        want, fit = _oracle(name, budget), _search(name, budget)
        if want is None:
            assert fit is None, budget
            continue
        plan = setting_plan(_plan(name)[1], want)
        assert (fit.plan.recompute, fit.plan.offload) == (plan.recompute, plan.offload), budget
        assert fit.step_s == _table(name)[want][1] and fit.memory.total <= budget
        chosen.add((plan.recompute, plan.offload))
        if name == "mixtral_tiny pp4" and budget < peaks[-1]:
            assert fit.time_evaluations == len(_table(name))  # an offload raised a peak: every setting ranked
        else:
            assert fit.memory_evaluations < len(_table(name)) / 10  # pruned
    assert len(chosen) >= 4  # the budgets reach past the plain modes


def test_nothing_fits_a_budget_under_the_smallest_peak():
    smallest = min(mem for mem, _ in _table("deepseek_v3_tiny pp2").values())
    assert _search("deepseek_v3_tiny pp2", smallest - 1) is None
    assert _search("deepseek_v3_tiny pp2", smallest) is not None


def test_a_generous_budget_takes_no_module():
    table = _table("deepseek_v3_tiny pp2")
    fit = _search("deepseek_v3_tiny pp2", 2 * max(mem for mem, _ in table.values()))
    assert (fit.plan.recompute, fit.plan.offload) == ("none", "")
    assert fit.memory_evaluations == 1  # the plain layout fits: nothing else is evaluated


def test_a_bound_leaves_out_what_is_slower():
    """``bound_s``: only settings as fast are searched (the planner's best variant of a mapping so far)."""
    table = _table("deepseek_v3_tiny pp2")
    budget = sorted(mem for mem, _ in table.values())[len(table) // 10]
    want = _oracle("deepseek_v3_tiny pp2", budget)
    assert _search("deepseek_v3_tiny pp2", budget, bound_s=table[want][1] * (1 - 1e-9)) is None
    assert _search("deepseek_v3_tiny pp2", budget, bound_s=table[want][1]).step_s == table[want][1]
