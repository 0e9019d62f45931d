"""The planner's answers stay the same as its speed changes: every plan, step time, MFU and memory of a few
plannings, compared bit for bit (floats by ``repr``) with what the planner answered before its enumeration
was cached (``tests/unit/data/planner_golden.json``, recorded with the code of that time).

Regenerate (only when a change of the cost model is meant): ``python -m tests.unit.test_planner_golden``.
"""

import hashlib
import json
import os
import sys

import pytest

from folding.model.presets import get_preset
from folding.planning.hardware import GIB, get_gpu
from folding.planning.planner import describe_plan, plan_layouts
from folding.planning.step_time import Cluster, TrainingShape

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "planner_golden.json")
HEAD = 40
"""Results kept in full in the golden file (the rest only through its digest), to show where a change starts."""

CASES = {
    # tools.plan --model qwen3_30b_a3b --world 64 --seq-length 4096 --global-batch-size 512 (the best per mapping)
    "qwen3_30b_a3b_w64": dict(model="qwen3_30b_a3b", world=64, seq=4096, gbs=512, kw={}),
    # every variant (VPP, recompute, optimizer) of every mapping, MLA and multi-token prediction
    "deepseek_v3_tiny_w8_all": dict(model="deepseek_v3_tiny", world=8, seq=1024, gbs=32, kw=dict(distinct=False)),
    # the recompute / offload modules that fit a budget (the memory_gib path)
    "mixtral_8x7b_w32_fit": dict(model="mixtral_8x7b", world=32, seq=4096, gbs=128, kw=dict(memory_gib=60.0)),
    # overlapped MoE exchanges and the node-aware dispatcher, across nodes
    "qwen2_57b_w64_overlap_hier": dict(
        model="qwen2_57b_a14b",
        world=64,
        seq=4096,
        gbs=256,
        kw=dict(overlap_moe_comm=True, delay_wgrad=True, dispatcher="hierarchical"),
    ),
}


def snapshot(case: dict) -> list:
    """Every result of ``case``'s planning, in order: the layout, its knobs, and its numbers (floats as
    ``repr``, so any change of the last bit shows)."""
    results = plan_layouts(
        get_preset(case["model"]),
        cluster=Cluster(gpu=get_gpu("h100"), num_gpus=case["world"]),
        shape=TrainingShape(seq_length=case["seq"], global_batch_size=case["gbs"]),
        **case["kw"],
    )
    return [
        [
            describe_plan(r.plan),
            r.plan.recompute,
            r.plan.offload,
            r.plan.distributed_optimizer,
            repr(r.time.step_s),
            repr(r.mfu),
            repr(r.memory.total / GIB),
            r.memory.stage,
        ]
        for r in results
    ]


def record(rows: list) -> dict:
    """What the golden file keeps of a snapshot: the count, the first :data:`HEAD` rows, and a SHA-256 of all."""
    text = json.dumps(rows, separators=(",", ":"))
    return {"count": len(rows), "head": rows[:HEAD], "sha256": hashlib.sha256(text.encode()).hexdigest()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_planner_answers_as_before(name):
    with open(GOLDEN) as f:
        want = json.load(f)[name]
    got = record(json.loads(json.dumps(snapshot(CASES[name]))))
    for i, (g, w) in enumerate(zip(got["head"], want["head"])):
        assert g == w, f"{name}: plan {i} differs:\n now    {g}\n before {w}"
    assert got["count"] == want["count"], f"{name}: {got['count']} plans, {want['count']} before"
    assert got["sha256"] == want["sha256"], f"{name}: a plan after the first {HEAD} differs"


if __name__ == "__main__":
    out = {name: record(snapshot(case)) for name, case in sorted(CASES.items())}
    with open(GOLDEN, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {GOLDEN}: " + ", ".join(f"{k} {v['count']} plans" for k, v in out.items()), file=sys.stderr)
