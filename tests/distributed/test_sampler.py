"""Layout-independent data on real ranks: every rank builds its iterators from the same config, takes its
DP rank from the folded layout, and the assembled global batches must equal the 1-rank reference.

- 4 ranks, attention TP2 DP2, MoE ETP1 EP4: an epoch is consumed exactly once across the DP ranks,
  TP/EP peers read identical micro-batches, and a mid-step resume continues exactly.
- 3 layouts with DP = 4, 2, 1 on 4 ranks: identical global batches at every step, blended data.
- 4 ranks building the embedded corpus and the sample-index caches at once get identical results.
"""

import hashlib
import os

import numpy as np
import torch
import torch.distributed as dist

from folding.data import DataConfig, IndexedDatasetWriter, build_data
from folding.parallel import ParallelLayout, build_parallel_state

SEQ, GBS, MBS = 16, 8, 2


def _write(path, n_docs, base):
    """Document d: token (base + d % 200) repeated, with a position ramp so samples are distinguishable."""
    with IndexedDatasetWriter(path, dtype=np.uint16) as w:
        for d in range(n_docs):
            n = 5 + (d * 7) % 23
            w.add_document([(base + d + k) % 250 for k in range(n)] + [256])


def _take(it, n):
    out = []
    for _ in range(n):
        mb = next(it)
        out.append({k: mb[k].clone() for k in ("tokens", "labels", "loss_mask", "sample_index", "dataset_index")})
    return out


def _epoch_and_resume(cfg_kwargs, steps, resume_after):
    layout = ParallelLayout(world_size=dist.get_world_size(), tp=2, ep=4, etp=1)
    ps = build_parallel_state(layout)
    try:
        assert layout.dp == 2 and layout.edp == 1
        kw = dict(
            seq_length=SEQ, global_batch_size=GBS, micro_batch_size=MBS, dp_rank=ps.coords.dp.rank, dp_size=layout.dp
        )
        data = build_data(DataConfig(**cfg_kwargs), **kw)
        n_micro = data.train.num_micro_batches
        full = _take(data.train, steps * n_micro)
        # interrupted run: stop after `resume_after` micro-batches (mid-step), restore into a fresh build
        first = build_data(DataConfig(**cfg_kwargs), **kw)
        part = _take(first.train, resume_after)
        state = first.state_dict()
        second = build_data(DataConfig(**cfg_kwargs), **kw)
        second.load_state_dict(state)
        rest = _take(second.train, steps * n_micro - resume_after)
        return {
            "dp_rank": ps.coords.dp.rank,
            "tp_rank": ps.coords.tp.rank,
            "ep_rank": ps.coords.ep.rank,
            "full": full,
            "resumed": part + rest,
            "n_epoch": data.train.dataset.samples_per_epoch,
            "n_micro": n_micro,
        }
    finally:
        ps.destroy()


def _reference_global_batches(cfg_kwargs, steps):
    data = build_data(
        DataConfig(**cfg_kwargs), seq_length=SEQ, global_batch_size=GBS, micro_batch_size=MBS, dp_rank=0, dp_size=1
    )
    return [_take(data.train, GBS // MBS) for _ in range(steps)]


def _assemble(results, steps, n_micro):
    """Global batch per step from each DP rank's micro-batches (DP rank order, micro-batch order)."""
    by_dp = {}
    for r in results:
        by_dp.setdefault(r["dp_rank"], r)
    dp = len(by_dp)
    return [[mb for d in range(dp) for mb in by_dp[d]["full"][s * n_micro : (s + 1) * n_micro]] for s in range(steps)]


def _same(a, b):
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x) and len(a) == len(b)


def test_epoch_once_and_exact_resume_dp2_ep4(ranks, tmp_path):
    _write(str(tmp_path / "a"), 60, 0)
    cfg = dict(paths=[str(tmp_path / "a")], split="90,10,0", cache_dir=str(tmp_path / "cache"), seed=7)
    ref_probe = build_data(
        DataConfig(**{**cfg, "cache_dir": str(tmp_path / "ref-cache")}),
        seq_length=SEQ,
        global_batch_size=GBS,
        micro_batch_size=MBS,
        dp_rank=0,
        dp_size=1,
    )
    n_epoch = ref_probe.train.dataset.samples_per_epoch
    steps = -(-n_epoch // GBS) + 1  # more than one epoch
    results = ranks(4).run(_epoch_and_resume, cfg, steps, resume_after=3)
    n_micro = results[0]["n_micro"]
    assert n_micro == GBS // (2 * MBS) == 2 and all(r["n_epoch"] == n_epoch for r in results)
    # TP peers (which are also EP peers here) read identical micro-batches; the two DP ranks differ
    assert sorted((r["dp_rank"], r["tp_rank"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({r["ep_rank"] for r in results}) == 4
    for r in results:
        peer = next(q for q in results if q["dp_rank"] == r["dp_rank"])
        assert _same(r["full"], peer["full"])
    # every sample index of the first epoch is consumed exactly once across the DP ranks
    seen = [int(i) for r in results if r["tp_rank"] == 0 for mb in r["full"] for i in mb["sample_index"]]
    first_epoch = sorted(i for i in seen if i < n_epoch)
    assert first_epoch == list(range(n_epoch))
    assert len(seen) == len(set(seen)) == steps * GBS
    # ... and those indices are distinct samples: the first epoch's contents tile its token stream
    ds = ref_probe.train.dataset
    assert sorted(ds.locate(i)[1] for i in range(n_epoch)) == list(range(n_epoch))
    contents = {tuple(ds[i][0].tolist()) for i in range(n_epoch)}
    assert len(contents) == n_epoch
    # the global batch at every step equals the 1-rank run (independent cache directory)
    ref = _reference_global_batches({**cfg, "cache_dir": str(tmp_path / "ref-cache")}, steps)
    got = _assemble(results, steps, n_micro)
    assert all(_same(g, r) for g, r in zip(got, ref))
    # the mid-step resume (after 3 micro-batches = 1.5 steps) reproduces the uninterrupted run exactly
    for r in results:
        assert _same(r["resumed"], r["full"])


LAYOUTS = [dict(tp=1, ep=2, etp=1), dict(tp=2, ep=4, etp=1), dict(tp=2, cp=2, ep=4, etp=1)]


def _global_batches_for_layouts(cfg_kwargs, steps):
    out = []
    for kw in LAYOUTS:
        layout = ParallelLayout(world_size=dist.get_world_size(), **kw)
        ps = build_parallel_state(layout)
        try:
            data = build_data(
                DataConfig(**cfg_kwargs),
                seq_length=SEQ,
                global_batch_size=GBS,
                micro_batch_size=1,
                dp_rank=ps.coords.dp.rank,
                dp_size=layout.dp,
            )
            n_micro = data.train.num_micro_batches
            full = _take(data.train, steps * n_micro)
            out.append(
                {
                    "dp": layout.dp,
                    "dp_rank": ps.coords.dp.rank,
                    "full": full,
                    "n_micro": n_micro,
                    "state": data.state_dict(),
                }
            )
        finally:
            ps.destroy()
    return out


def test_global_batch_identical_across_layouts(ranks, tmp_path):
    _write(str(tmp_path / "a"), 50, 0)
    _write(str(tmp_path / "b"), 30, 120)
    cfg = dict(
        paths=[str(tmp_path / "a"), str(tmp_path / "b")],
        weights=[0.6, 0.4],
        split="9,1,0",
        cache_dir=str(tmp_path / "cache"),
        seed=3,
        blend_block_size=8,
    )
    steps = 5
    per_rank = ranks(4).run(_global_batches_for_layouts, cfg, steps)
    ref_data = build_data(
        DataConfig(**cfg), seq_length=SEQ, global_batch_size=GBS, micro_batch_size=1, dp_rank=0, dp_size=1
    )
    ref = [_take(ref_data.train, GBS) for _ in range(steps)]
    assert {int(mb["dataset_index"].item()) for step in ref for mb in step} == {0, 1}  # a real blend
    dps = []
    for li in range(len(LAYOUTS)):
        results = [r[li] for r in per_rank]
        dps.append(results[0]["dp"])
        got = _assemble(results, steps, results[0]["n_micro"])
        assert all(_same(g, r) for g, r in zip(got, ref)), LAYOUTS[li]
        for r in results:  # ranks sharing a DP rank read the same micro-batches
            peer = next(q for q in results if q["dp_rank"] == r["dp_rank"])
            assert _same(r["full"], peer["full"])
        assert all(r["state"]["train"]["consumed_samples"] == steps * GBS for r in results)
    assert dps == [4, 2, 1]
    # a state saved at a step boundary under DP=4 resumes under DP=1 on the same samples
    resumed = build_data(
        DataConfig(**cfg), seq_length=SEQ, global_batch_size=GBS, micro_batch_size=1, dp_rank=0, dp_size=1
    )
    state = per_rank[0][0]["state"]
    state["train"]["consumed_samples"] = 2 * GBS
    resumed.load_state_dict(state)
    assert all(_same(_take(resumed.train, GBS), ref[s]) for s in (2, 3, 4))


def _corpus_at_once(cache_dir):
    data = build_data(
        DataConfig(cache_dir=cache_dir), seq_length=64, global_batch_size=4, micro_batch_size=1, dp_rank=0, dp_size=1
    )
    with open(data.prefixes[0] + ".bin", "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return digest, next(data.train)["tokens"], sorted(os.listdir(cache_dir))


def test_embedded_corpus_built_once_by_concurrent_ranks(ranks, tmp_path):
    cache = str(tmp_path / "shared-cache")
    results = ranks(4).run(_corpus_at_once, cache)
    local = _corpus_at_once(str(tmp_path / "local-cache"))
    assert all(r[0] == local[0] for r in results)
    assert all(torch.equal(r[1], local[1]) for r in results)
    # published by rename: only finished directories and their lock files, no temporary leftovers
    names = results[0][2]
    assert not [n for n in names if ".tmp-" in n] and "corpus-byte-v1" in names, names
