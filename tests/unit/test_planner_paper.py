"""The planner against the MoE Parallel Folding paper's four H100 rows (REFERENCE.md §5).

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
    res = plan_layouts(get_preset(name), cluster=Cluster(gpu=get_gpu("h100"), num_gpus=n), shape=SHAPE,
                       folded=folded)
    return [tuple(getattr(r.plan, k) for k in MATCH_KEYS) for r in res], res


def test_calibration_reproduces_the_constant():
    eff = calibrate_compute_efficiency(get_preset("mixtral_8x22b"), cluster=Cluster(gpu=get_gpu("h100"), num_gpus=128),
                                       shape=SHAPE, mapping=dict(tp=2, cp=1, pp=8, ep=8, etp=1), target_mfu=0.493)
    assert eff == pytest.approx(COMPUTE_EFFICIENCY, abs=1e-3)


# Known gaps (docs/planner.md): the model is too optimistic for these two rows, strict so that they fail loudly
# the day the model is within ±5 points.
G8T8_MFU = ("predicted 34.4% vs the paper's 28.8% (+5.6): the model is too optimistic for 64 fine-grained top-8 "
            "experts (small grouped GEMMs, 8 routed copies per token to permute and exchange)")
LLAMA3_MFU = ("predicted 47.4% vs the paper's 41.6% (+5.8): the model is too optimistic for TP8 PP16 VPP5 on 256 GPUs "
              "(sequence-parallel traffic hidden behind GEMMs, pipeline sends counted without contention)")


@pytest.mark.parametrize("name", [
    "mixtral_8x22b", "qwen2_57b_a14b",
    pytest.param("mixtral_8x22b_g8t8", marks=pytest.mark.xfail(strict=True, reason=G8T8_MFU)),
    pytest.param("llama3_8x70b", marks=pytest.mark.xfail(strict=True, reason=LLAMA3_MFU)),
])
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


# Known gap of the cost model (docs/planner.md, "Calibration and results"): strict, so that it fails loudly
# the day the model ranks this layout in the top 3.
QWEN_GAP = ("the model ranks Qwen2-57B-A14B's TP2 PP4 EP4 ETP1 5th (5% behind the best, TP2 PP4 VPP7 EP8): with "
            "EP4 each GPU holds twice the expert weights of EP8, and their reduce-scatter / all-gather over the "
            "inter-node EDP group (9 GB of fp32 gradients) is not hidden behind the chunks' backward / forward")


@pytest.mark.parametrize("name", [
    "mixtral_8x22b", "llama3_8x70b", "mixtral_8x22b_g8t8",
    pytest.param("qwen2_57b_a14b", marks=pytest.mark.xfail(strict=True, reason=QWEN_GAP)),
])
def test_folded_layout_in_top_3(name):
    keys, _ = _ranked(name, True)
    assert keys.index(ROWS[name][1]) < 3
