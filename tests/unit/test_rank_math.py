"""Rank math against an independent reshape/permute oracle, the worked examples, and bad layouts."""

import itertools
import random

import numpy as np
import pytest

from folding.parallel import LayoutError, ParallelLayout, RankGenerator
from folding.parallel.rank_math import ATTENTION_TOKENS, AXES, EXPERT_TOKENS


def oracle_groups(sizes: dict, order: str, token: str):
    """Groups by reshaping ``arange(world)`` and permuting axes (a different algorithm from the loop
    in ``RankGenerator``): grid dims are the order reversed (C-order: the fastest axis is last);
    other axes go first, selected axes last, each block reversed so the first-named axis is fastest."""
    names = order.split("-") + [a for a in AXES if a not in order.split("-")]
    n = len(names)
    world = int(np.prod([sizes[a] for a in names]))
    grid = np.arange(world).reshape([sizes[a] for a in reversed(names)])
    sel = [i for i, a in enumerate(names) if a in token.split("-")]
    other = [i for i, a in enumerate(names) if a not in token.split("-")]
    perm = [n - 1 - i for i in reversed(other)] + [n - 1 - i for i in reversed(sel)]
    width = int(np.prod([sizes[names[i]] for i in sel]))
    return grid.transpose(perm).reshape(-1, width).tolist()


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def random_layouts(count, seed=0):
    rng = random.Random(seed)
    worlds = [1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1344, 2048, 4096]
    out = []
    while len(out) < count:
        w = rng.choice(worlds)
        pp = rng.choice(divisors(w))
        tp = rng.choice(divisors(w // pp))
        cp = rng.choice(divisors(w // (pp * tp)))
        etp = rng.choice(divisors(w // pp))
        ep = rng.choice(divisors(w // (pp * etp)))
        if rng.random() < 0.7:
            order = "tp-cp-ep-dp-pp"
        else:
            axes = ["tp", "cp", "ep", "dp"]
            rng.shuffle(axes)
            order = "-".join(axes + ["pp"]) if rng.random() < 0.8 else "-".join(rng.sample(AXES, 5))
        try:
            lay = ParallelLayout(world_size=w, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)
        except LayoutError:
            continue  # e.g. pp not last with EDP != DP
        out.append(lay)
    return out


LAYOUTS = random_layouts(300)


def test_layout_sample_is_broad():
    assert max(l.world_size for l in LAYOUTS) == 4096
    assert any(l.order != "tp-cp-ep-dp-pp" for l in LAYOUTS)
    assert any(l.ep > l.dp for l in LAYOUTS)  # EP folded over TP/CP ranks, beyond what DP offers
    assert any(l.etp != l.tp for l in LAYOUTS)


@pytest.mark.parametrize("chunk", range(6))
def test_against_oracle(chunk):
    for lay in LAYOUTS[chunk::6]:
        groups = lay.groups()
        att = dict(tp=lay.tp, cp=lay.cp, ep=1, dp=lay.dp, pp=lay.pp)
        exp = dict(tp=lay.etp, cp=1, ep=lay.ep, dp=lay.edp, pp=lay.pp)
        for tok in ATTENTION_TOKENS:
            assert groups["attention"][tok] == oracle_groups(att, lay.order, tok), (lay, tok)
        for tok in EXPERT_TOKENS:
            assert groups["expert"][tok] == oracle_groups(exp, lay.order, tok), (lay, tok)
        # every group partitions the world exactly once
        for view in groups.values():
            for tok, gs in view.items():
                if tok == "embedding":
                    continue
                flat = sorted(itertools.chain.from_iterable(gs))
                assert flat == list(range(lay.world_size)), (lay, tok)


def test_multi_axis_token_order_does_not_matter():
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=2, order="tp-cp-ep-dp-pp")
    assert gen.get_ranks("dp-cp") == gen.get_ranks("cp-dp")
    assert gen.get_ranks("tp-dp-cp") == gen.get_ranks("cp-tp-dp")


def test_worked_example_8_ranks():
    # worked example: 8 ranks, attention TP2 CP2 DP2, MoE ETP1 EP8 EDP1.
    g = ParallelLayout(world_size=8, tp=2, cp=2, ep=8, etp=1).groups()
    a, e = g["attention"], g["expert"]
    assert a["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert a["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert a["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert a["dp-cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert a["tp-cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert e["ep"] == [list(range(8))]
    assert e["tp"] == [[r] for r in range(8)]
    assert e["dp"] == [[r] for r in range(8)]


def test_worked_example_16_ranks():
    # worked example: 16 ranks, attention TP2 CP1 DP4 PP2, MoE ETP1 EP2 EDP4.
    g = ParallelLayout(world_size=16, tp=2, pp=2, ep=2, etp=1).groups()
    assert g["attention"]["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g["expert"]["ep"] == [[2 * i, 2 * i + 1] for i in range(8)]
    assert g["expert"]["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g["attention"]["pp"] == [[i, i + 8] for i in range(8)]
    assert g["expert"]["pp"] == g["attention"]["pp"]
    assert g["attention"]["embedding"] == [[i, i + 8] for i in range(8)]


def test_derived_sizes_and_etp_default():
    lay = ParallelLayout(world_size=64, tp=2, cp=2, pp=4, ep=8, etp=1)
    assert (lay.dp, lay.edp) == (4, 2)
    assert ParallelLayout(world_size=8, tp=2, ep=2).etp == 2
    assert "EP8" in lay.describe()


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(world_size=8, tp=3), "parallel.tp*cp*pp"),
        (dict(world_size=8, tp=2, ep=8), "etp defaults to tp"),
        (dict(world_size=8, ep=3), "parallel.etp*ep*pp"),
        (dict(world_size=8, ep=4, num_experts=6), "num_experts=6"),
        (dict(world_size=8, vpp=2), "parallel.vpp"),
        (dict(world_size=8, tp=0), "parallel.tp"),
        (dict(world_size=8, cp=-1), "parallel.cp"),
        (dict(world_size=8, ep=1.5), "parallel.ep"),
        (dict(world_size=8, order="tp-cp-xx-dp-pp"), "unknown axis 'xx'"),
        (dict(world_size=8, order="tp-tp-ep-dp-pp"), "repeats axis 'tp'"),
        (dict(world_size=8, tp=2, order="cp-ep-dp-pp"), "omits axis 'tp'"),
        (dict(world_size=16, pp=2, ep=4, etp=1, order="tp-cp-ep-pp-dp"), "put 'pp' last"),
        (dict(world_size=0), "world_size"),
    ],
)
def test_bad_layouts(kwargs, needle):
    with pytest.raises(LayoutError, match=None) as err:
        ParallelLayout(**kwargs)
    assert needle in str(err.value)


def test_pp_not_last_allowed_when_edp_equals_dp():
    lay = ParallelLayout(world_size=16, tp=2, pp=2, ep=2, etp=1, order="tp-cp-ep-pp-dp")
    assert lay.edp == lay.dp == 4
    g = lay.groups()
    assert g["attention"]["pp"] == g["expert"]["pp"]
