"""The planner against the MoE Parallel Folding paper's four H100 rows (docs/planner.md).

Only the Mixtral-8x22B row sets the calibration constant; the other three are predictions. For each row
the paper's folded layout (matched on TP, CP, PP, EP, ETP) must predict an MFU within ±5 points of the
paper's, rank in the planner's top 3, and beat its Megatron-Core counterpart without folding. That
counterpart keeps TP, CP, PP and sets ETP = TP (Megatron-Core's default) with EP carved out of DP; where the
folded EP is then illegal (ETP·EP·PP > world) it takes the largest legal EP.
"""

import functools

import pytest

from folding.model.presets import get_preset
from folding.planning.hardware import get_gpu
from folding.planning.planner import COMPUTE_EFFICIENCY, MATCH_KEYS, calibrate_compute_efficiency, plan_layouts
from folding.planning.step_time import Cluster, TrainingShape

SHAPE = TrainingShape(seq_length=4096, global_batch_size=256)

# model, GPUs, folded (tp, cp, pp, ep, etp), paper MFU, MCore counterpart (tp, cp, pp, ep, etp), paper MFU
ROWS = {
    "mixtral_8x22b": (128, (2, 1, 8, 8, 1), 0.493, (2, 1, 8, 8, 2), 0.463),
    "qwen2_57b_a14b": (64, (2, 1, 4, 4, 1), 0.390, (2, 1, 4, 4, 2), 0.353),
    "mixtral_8x22b_g8t8": (128, (4, 1, 8, 8, 1), 0.288, (4, 1, 8, 4, 4), 0.171),
    "llama3_8x70b": (256, (8, 1, 16, 8, 1), 0.416, (8, 1, 16, 2, 8), 0.388),
}


@functools.lru_cache(maxsize=None)
def _ranked(name: str, folded: bool):
    n = ROWS[name][0]
    res = plan_layouts(get_preset(name), cluster=Cluster(gpu=get_gpu("h100"), num_gpus=n), shape=SHAPE, folded=folded)
    return [tuple(getattr(r.plan, k) for k in MATCH_KEYS) for r in res], res


def test_calibration_reproduces_the_constant():
    eff = calibrate_compute_efficiency(
        get_preset("mixtral_8x22b"),
        cluster=Cluster(gpu=get_gpu("h100"), num_gpus=128),
        shape=SHAPE,
        mapping=dict(tp=2, cp=1, pp=8, ep=8, etp=1),
        target_mfu=0.493,
    )
    assert eff == pytest.approx(COMPUTE_EFFICIENCY, abs=1e-3)


@pytest.mark.parametrize("name", list(ROWS))
def test_folded_layout_mfu_within_5_points(name):
    keys, res = _ranked(name, True)
    _, folded, paper, _, _ = ROWS[name]
    assert folded in keys, f"{folded} does not fit or is not enumerated"
    assert abs(res[keys.index(folded)].mfu - paper) <= 0.05


@pytest.mark.parametrize("name", list(ROWS))
def test_folded_beats_mcore_without_folding(name):
    keys, res = _ranked(name, True)
    ukeys, ures = _ranked(name, False)
    _, folded, _, mcore, _ = ROWS[name]
    assert mcore in ukeys
    assert res[keys.index(folded)].time.step_s < ures[ukeys.index(mcore)].time.step_s


# Known gaps of the cost model (docs/planner.md, "Calibration and results"): strict, so that they fail loudly the
# day the model ranks these layouts in the top 3.
QWEN_GAP = (
    "the model ranks Qwen2-57B-A14B's TP2 PP4 EP4 ETP1 9th (37.6%, behind TP2 PP4 EP8 at 39.6%, TP2 PP2 "
    "EP8 at 38.3%, TP1 CP2 PP4 EP8 at 37.7% and five PP8 layouts of 2 + 6 x 4 + 2 layers at 37.7-38.3%): EP4 holds "
    "twice EP8's expert weights per GPU, and their gradient reduce-scatter / parameter all-gather over the "
    "inter-node EDP group leave 0.36 s exposed per step against EP8's 0.15 s, more than EP8's larger "
    "all-to-all costs (0.36 s vs 0.31 s)"
)
G8T8_GAP = (
    "the model ranks Mixtral-8x22B-G8T8's TP4 PP8 EP8 ETP1 5th (32.2%, behind TP1 CP2 / TP2 / TP1 CP4 / "
    "TP2 CP2 with PP8 EP8 at 33.6-32.7%): at 1024 tokens per rank TP4 exposes more sequence-parallel traffic "
    "than TP2 (0.22 s vs 0.08 s per step); what made TP4 the paper's best is not modelled"
)


@pytest.mark.parametrize(
    "name",
    [
        "mixtral_8x22b",
        "llama3_8x70b",
        pytest.param("mixtral_8x22b_g8t8", marks=pytest.mark.xfail(strict=True, reason=G8T8_GAP)),
        pytest.param("qwen2_57b_a14b", marks=pytest.mark.xfail(strict=True, reason=QWEN_GAP)),
    ],
)
def test_folded_layout_in_top_3(name):
    keys, _ = _ranked(name, True)
    assert keys.index(ROWS[name][1]) < 3
