"""The planner with a memory budget (``plan_layouts(memory_gib=...)``, ``tools.plan --memory-gib [N]``): each
layout gets the fastest recompute and offload modules that fit, so every mapping the plain recompute modes
fit stays, none gets slower, some get faster, and every plan fits the budget; the listed line and its ``run:``
overrides name the modules."""

import pytest

from folding.model.presets import get_preset
from folding.planning.hardware import GIB, get_gpu
from folding.planning.planner import MATCH_KEYS, plan_layouts
from folding.planning.step_time import Cluster, TrainingShape

CFG = get_preset("qwen3_30b_a3b")
CLUSTER = Cluster(gpu=get_gpu("h100"), num_gpus=8)
SHAPE = TrainingShape(seq_length=4096, global_batch_size=64)
ARGS = ["--model", "qwen3_30b_a3b", "--world", "8", "--seq-length", "4096", "--global-batch-size", "64"]


def _by_mapping(results):
    return {tuple(getattr(r.plan, k) for k in MATCH_KEYS): r for r in results}


def test_a_budget_keeps_every_mapping_and_speeds_some_up():
    modes = _by_mapping(plan_layouts(CFG, cluster=CLUSTER, shape=SHAPE))
    usable = CLUSTER.gpu.usable_memory_gib
    fitted = _by_mapping(plan_layouts(CFG, cluster=CLUSTER, shape=SHAPE, memory_gib=usable))
    assert modes and set(modes) <= set(fitted)
    faster = 0
    for key, r in modes.items():  # the modes are settings of the search: none is missed
        assert fitted[key].time.step_s <= r.time.step_s * (1 + 1e-12), key
        faster += fitted[key].time.step_s < r.time.step_s * (1 - 1e-3)
    assert faster >= len(modes) // 2
    assert all(CLUSTER.gpu.fits(r.memory.total) for r in fitted.values())
    assert any(r.plan.offload for r in fitted.values())
    # a smaller budget: fewer mappings, each within it and using it (70 GiB: 1.05 x 66.67 GiB)
    small = plan_layouts(CFG, cluster=CLUSTER, shape=SHAPE, memory_gib=70.0)
    assert 0 < len(small) < len(fitted)
    assert all(r.memory.total * (1 + CLUSTER.gpu.fragmentation) <= 70 * GIB for r in small)
    assert max(r.memory_gib for r in small) > 66


def test_tool_lists_the_modules_and_runs_them(capsys):
    from tools.plan import main

    assert main([*ARGS, "--memory-gib", "--top", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "memory budget 72.0 GiB less 5% allocator overhead, cheapest recompute and offload modules" in lines[0]
    best = _by_mapping(plan_layouts(CFG, cluster=CLUSTER, shape=SHAPE, memory_gib=72.0))
    first = min(best.values(), key=lambda r: r.time.step_s).plan
    assert first.offload, first
    line = next(i for i, text in enumerate(lines) if text.lstrip().startswith("1  MFU"))
    assert f"recompute={first.recompute} offload={first.offload} " in lines[line]
    run = lines[line + 1].split()
    assert f"train.offload_modules=[{first.offload}]" in run
    assert any(t.startswith("train.recompute") for t in run)

    with pytest.raises(SystemExit):  # argparse: a budget must be a number
        main([*ARGS, "--memory-gib", "lots"])
    assert main([*ARGS, "--memory-gib", "0"]) == 2
    assert "--memory-gib=0.0: give the usable GiB per GPU, a positive number" in capsys.readouterr().err
