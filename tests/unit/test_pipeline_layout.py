"""``parallel.pipeline_layout``: Megatron-Core's ``--pipeline-model-parallel-layout`` strings, expanded and checked
by hand-worked cases, refused with the setting and the fix when they do not add up, compared with
megatron-core's own ``PipelineParallelLayerLayout`` on random layouts up to 64 stages, and a model chunk
without transformer layers (an empty virtual stage passes the hidden states through)."""

import random

import pytest
import torch

from folding.model.presets import get_preset
from folding.model.transformer import MoETransformer
from folding.moe.settings import LayerSettings
from folding.parallel import LayoutError, ParallelLayout
from folding.parallel.partition import partition_layers
from folding.parallel.pipeline_layout import (
    balanced_layout,
    check_pipeline_layout,
    compact_stage,
    expand_pipeline_layout,
    stage_symbols,
)
from tests.optional import require

DEEPSEEK = "Et|(tt|)*30mL"  # DeepSeek-V3 (61 layers, one MTP module) on PP8 VPP4


def test_expand_by_hand():
    stages = expand_pipeline_layout(DEEPSEEK)
    # "Et", then the group "tt|" thirty times, then "mL" closes the 31st "|": 1 + 30 + 1 stages
    assert len(stages) == 32 and stages[0] == "Et" and stages[-1] == "mL"
    assert set(stages[1:31]) == {"tt"}
    # x*N repeats one symbol ("|" included), commas are cosmetic, a stage may be empty
    assert expand_pipeline_layout("Et*3|(tt|)*29,m|L") == ("Ettt", *["tt"] * 29, "m", "L")
    assert expand_pipeline_layout("Et|*2tL") == ("Et", "", "tL")
    assert expand_pipeline_layout("E,t|t,L") == ("Et", "tL")
    assert expand_pipeline_layout("(t*2|)*2") == ("tt", "tt", "")
    assert expand_pipeline_layout("E|(t|)*0tL") == ("E", "tL")


def test_deepseek_v3_stages_on_pp8():
    """Virtual stage v on pipeline rank v % 8 as chunk v // 8: rank 0 holds stages 0, 8, 16, 24 (Et, tt, tt, tt:
    7 layers), ranks 1-6 four stages of 2, rank 7 stages 7, 15, 23, 31 (tt, tt, tt, mL: 6 layers)."""
    ranges = partition_layers(num_layers=61, pp=8, pipeline_layout=DEEPSEEK, mtp_num_layers=1)
    assert ranges[0] == (0, 1) and ranges[1] == (1, 3) and ranges[30] == (59, 61) and ranges[31] == (61, 61)
    per_rank = [sum(e - s for s, e in ranges[r::8]) for r in range(8)]
    assert per_rank == [7, 8, 8, 8, 8, 8, 8, 6]
    assert ParallelLayout(world_size=1024, tp=2, pp=8, ep=64, etp=1, pipeline_layout=DEEPSEEK).vpp == 4
    assert stage_symbols(ranges, mtp_num_layers=1) == expand_pipeline_layout(DEEPSEEK)
    assert [compact_stage(s) for s in ("Et", "tttttt", "", "tttttL")] == ["Et", "t*6", "-", "t*5L"]


def test_balanced_layouts_by_hand():
    # the embedding, each MTP module and the loss count as one layer: (61 + 1 + 2) / 32 = 2, (94 + 2) / 32 = 3
    assert balanced_layout(num_layers=61, mtp_num_layers=1, stages=32) == DEEPSEEK
    assert balanced_layout(num_layers=94, mtp_num_layers=0, stages=32) == "Ett|(ttt|)*30ttL"
    assert balanced_layout(num_layers=4, mtp_num_layers=0, stages=3) == "Et|tt|tL"  # 6 / 3 = 2
    assert balanced_layout(num_layers=4, mtp_num_layers=1, stages=2) is None  # 7 slots over 2 stages
    assert balanced_layout(num_layers=1, mtp_num_layers=3, stages=2) is None  # no room for 3 modules and L
    for n, d, v in ((61, 1, 32), (94, 0, 32), (4, 0, 3)):
        stages = check_pipeline_layout(balanced_layout(num_layers=n, mtp_num_layers=d, stages=v), pp=v)
        assert len(stages) == v and sum(s.count("t") for s in stages) == n


# (layout, pp, vpp, model layers, MTP modules, what the message must say)
REFUSED = [
    ("Et|tt|tL", 2, None, 5, 0, "lists 3 virtual stages, not a multiple of parallel.pp=2"),
    (DEEPSEEK, 8, 2, 61, 1, "means 4 per rank, not parallel.vpp=2"),
    ("tE|tL", 2, None, 2, 0, "E (the embedding) must open the first virtual stage"),
    ("Et|Et|tL", 3, None, 3, 0, "E (the embedding) must open the first virtual stage, once"),
    ("EtL|tt", 2, None, 3, 0, "L (the loss) must close the last virtual stage"),
    ("Et|tL|tL", 3, None, 3, 0, "L (the loss) must close the last virtual stage, once"),
    (DEEPSEEK, 8, None, 60, 1, "lists 61 transformer layers (t) but model.num_layers=60"),
    (DEEPSEEK, 8, None, 61, 0, "the model has none (model.mtp_num_layers=0)"),
    (DEEPSEEK, 8, None, 61, 2, "lists 1 multi-token-prediction module(s) (m) but model.mtp_num_layers=2"),
    # Megatron-Core runs these MTP placements ("standalone" MTP); folding runs the modules with the loss
    ("Et*3|(tt|)*29,m|L", 8, None, 61, 1, "m (a multi-token-prediction module) must sit in the last virtual stage"),
    ("Et|tmtL", 2, None, 3, 1, "after its transformer layers and before L"),
    ("Et||tL", 3, None, 2, 0, "pipeline rank 1 (virtual stages 1) holds nothing"),
    ("Et|(tt|)*mL", 2, None, 3, 0, "a '*' is not followed by a count"),
    ("Et|(tt|mL", 2, None, 3, 0, "a '(' is never closed"),
    ("Et|(tt|)L", 2, None, 3, 0, "the group (tt|) has no repeat count"),
    ("Et|((t|)*2)*2L", 2, None, 3, 0, "a group is empty or nested"),
    ("Et|x|L", 3, None, 1, 0, "'x' is not a layout symbol"),
    ("Et | tL", 2, None, 2, 0, "' ' is not a layout symbol"),
    ("", 1, None, 1, 0, "is not a layout string"),
]


@pytest.mark.parametrize("text,pp,vpp,layers,mtp,why", REFUSED)
def test_refused_naming_the_setting_and_the_fix(text, pp, vpp, layers, mtp, why):
    with pytest.raises(ValueError) as err:
        partition_layers(num_layers=layers, pp=pp, vpp=vpp, pipeline_layout=text, mtp_num_layers=mtp)
    msg = str(err.value)
    assert msg.startswith(f"parallel.pipeline_layout={text!r}: ") and why in msg and "; " in msg, msg


def test_parallel_layout_resolves_vpp_and_refuses_mixtures():
    lay = ParallelLayout(world_size=8, pp=2, pipeline_layout="Et|t|tt|L")
    assert lay.vpp == 2 and lay.virtual_stages == 2 and "PP2 VPP2 (layout Et|t|tt|L)" in lay.describe()
    assert ParallelLayout(world_size=8, pp=2, vpp=2, pipeline_layout="Et|t|tt|L").vpp == 2
    assert ParallelLayout(world_size=8, pp=2, vpp=1, pipeline_layout="Ett|ttL").vpp == 1
    assert ParallelLayout(world_size=1, pipeline_layout="EttL").vpp is None
    for kw, why in (
        (dict(pp=2, last_stage_layers=1), "cannot be combined with parallel.last_stage_layers=1"),
        (dict(pp=2, first_stage_layers=1), "cannot be combined with parallel.first_stage_layers=1"),
        (dict(pp=2, vpp=4), "not parallel.vpp=4"),
        (dict(pp=1), "needs pipeline parallelism"),
    ):
        with pytest.raises(LayoutError, match="parallel.pipeline_layout") as err:
            ParallelLayout(world_size=8, pipeline_layout="Et|t|tt|L", **kw)
        assert why in str(err.value)
    with pytest.raises(ValueError, match="cannot be combined"):
        partition_layers(num_layers=4, pp=2, pipeline_layout="Ett|ttL", last_stage_layers=2)


def test_a_chunk_without_layers_passes_the_hidden_states_through():
    """A middle virtual stage with no layer holds no parameter and returns its input; the last stage of
    ``...|mL`` holds the final norm, the output layer and the MTP module (with its embedding copy) but no
    decoder layer. An empty range must say which ends of the model it holds."""
    cfg = get_preset("deepseek_v3_tiny", hidden_size=32)
    with pytest.raises(ValueError, match="pre_process= and post_process="):
        MoETransformer(cfg, layer_range=(4, 4))
    with pytest.raises(ValueError, match="the first stage starts at layer 0"):
        MoETransformer(cfg, layer_range=(1, 2), pre_process=True, settings=LayerSettings(device="meta"))
    middle = MoETransformer(cfg, layer_range=(1, 1), pre_process=False, post_process=False)
    assert not list(middle.parameters()) and not middle.pre_process and not middle.post_process
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    h = torch.randn(8, 2, cfg.hidden_size)
    assert middle.stage_forward(ids, hidden_SBH=h) is h
    last = MoETransformer(
        cfg, layer_range=(4, 4), pre_process=False, post_process=True, settings=LayerSettings(device="meta")
    )
    names = {n.split(".")[0] for n, _ in last.named_parameters()}
    assert names == {"embedding", "final_norm", "mtp", "output_weight"} and len(last.layers) == 0


# ------------------------------------------------------------------------------------ megatron-core oracle
def _megatron():
    mod = require("megatron.core.transformer.pipeline_parallel_layer_layout")
    from megatron.core.transformer.enums import LayerType

    names = {LayerType.embedding: "E", LayerType.decoder: "t", LayerType.mtp: "m", LayerType.loss: "L"}
    return mod, names


def _random_layout(rng):
    """A layout folding runs: pp ranks x vpp chunks, random layer counts (0 to 3) per stage, E first, the
    modules and L last; written with the repetition syntax where stages repeat."""
    pp, vpp = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 3, 4, 8])
    vpp = 1 if pp == 1 else vpp
    V = pp * vpp
    counts = [rng.randint(0, 3) for _ in range(V)]
    counts[0] = max(counts[0], 1)  # rank 0 holds E anyway; keep the other ranks non-empty below
    for r in range(pp):
        if not any(counts[v] for v in range(r, V, pp)) and r != pp - 1:
            counts[r] = 1
    mtp = rng.choice([0, 0, 1, 2])
    stages = ["t" * n for n in counts]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "m" * mtp + "L"  # the same stage as the first when V = 1
    text = "|".join(stages)
    if V > 2 and len(set(stages[1:-1])) == 1:  # the stages between repeat: write them as a group
        text = f"{stages[0]}|({stages[1]}|)*{V - 2}{stages[-1]}"
    return text, pp, vpp, sum(counts), mtp


def test_random_layouts_match_megatron_core(monkeypatch):
    """Random layouts up to 64 virtual stages: the same stages, the same vpp and, for every (rank, chunk), the
    same decoder layer ids as megatron-core's ``PipelineParallelLayerLayout``, which also accepts each."""
    mod, names = _megatron()
    from megatron.core import parallel_state

    rng = random.Random(58)
    cases = [_random_layout(rng) for _ in range(200)] + [(DEEPSEEK, 8, 4, 61, 1), ("Ett|(ttt|)*30ttL", 8, 4, 94, 0)]
    for text, pp, vpp, layers, mtp in cases:
        ref = mod.PipelineParallelLayerLayout(text, pp)
        assert ref.validate_layer_layout(num_layers=layers, mtp_num_layers=mtp or None) is False  # not standalone
        assert ref.virtual_pipeline_model_parallel_size == vpp, text
        flat = ["".join(names[x] for x in stage) for stage in mod.PipelineParallelLayerLayout.parse_str_to_list(text)]
        assert list(expand_pipeline_layout(text)) == flat, text
        ranges = partition_layers(num_layers=layers, pp=pp, vpp=vpp, pipeline_layout=text, mtp_num_layers=mtp)
        monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: vpp)
        for v, (s, e) in enumerate(ranges):
            assert ref.get_layer_id_list(vp_stage=v // pp, pp_rank=v % pp) == list(range(s, e)), (text, v)


def test_what_megatron_core_also_refuses_and_what_it_runs_that_folding_does_not():
    """Of the layouts folding refuses, megatron-core's ``PipelineParallelLayerLayout`` refuses every one but two:
    MTP in the last chunk of another pipeline rank ("standalone" MTP) and a rank of empty stages, which it
    runs and folding refuses naming the fix. (A ``vpp`` that disagrees is refused by its TransformerConfig,
    not by the layout class: that row is left out.)"""
    mod, _ = _megatron()
    megatron_runs = {"Et*3|(tt|)*29,m|L": True, "Et||tL": False}  # layout -> whether its MTP is standalone
    for text, pp, vpp, layers, mtp, _ in REFUSED:
        if vpp is not None:
            continue
        try:
            ref = mod.PipelineParallelLayerLayout(text, pp)
            standalone = ref.validate_layer_layout(num_layers=layers, mtp_num_layers=mtp or None)
        except (AssertionError, ValueError, IndexError):
            assert text not in megatron_runs, text
            continue
        assert text in megatron_runs and megatron_runs[text] is standalone, text
