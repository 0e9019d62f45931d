"""GPT sample construction, splits, blends, the micro-batch iterator and the embedded corpus (1 process)."""

import multiprocessing as mp
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from folding.data import (
    BlendedDataset,
    DataConfig,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetWriter,
    MicroBatchIterator,
    build_data,
    parse_split,
    split_ranges,
)
from folding.data.cache import build_once

EOD = 999


def make_dataset(path, n_docs=23, seed=0, multi_seq=False):
    """Documents with globally unique token values (doc d holds 1000*(d+1) + k), EOD-terminated."""
    rng = np.random.default_rng(seed)
    docs = []
    with IndexedDatasetWriter(path, dtype=np.int32) as w:
        for d in range(n_docs):
            n = int(rng.integers(1, 30))
            toks = (1000 * (d + 1) + np.arange(n)).tolist() + [EOD]
            docs.append(toks)
            if multi_seq and n > 3:
                w.add_document(toks[:3], toks[3:])
            else:
                w.add_document(toks)
    return docs


def reference_epoch(docs, doc_ids_in_order, seq_length):
    """Naive construction: concatenate, cut with stride seq_length and length seq_length + 1."""
    stream = [t for d in doc_ids_in_order for t in docs[d]]
    out = []
    for start in range(0, len(stream) - 1, seq_length):
        out.append(stream[start : start + seq_length + 1])
    return out


@pytest.mark.parametrize("multi_seq", [False, True])
@pytest.mark.parametrize("seq_length", [1, 7, 16])
def test_gpt_samples_match_naive_construction(tmp_path, multi_seq, seq_length):
    docs = make_dataset(str(tmp_path / "d"), multi_seq=multi_seq)
    ix = IndexedDataset(str(tmp_path / "d"))
    ds = GPTDataset(ix, documents=(3, 20), seq_length=seq_length, seed=5, stream="train/0", pad=EOD)
    n = ds.samples_per_epoch
    assert ds.num_tokens == sum(len(docs[d]) for d in range(3, 20))
    for epoch in range(2):
        got = [ds[epoch * n + k] for k in range(n)]
        order_docs = [int(x) for x in ix.document_indices.searchsorted(ds._epoch(epoch)[0], side="right") - 1]
        doc_order = list(dict.fromkeys(order_docs))
        assert sorted(doc_order) == list(range(3, 20))  # a permutation of the split's documents
        ref = reference_epoch(docs, doc_order, seq_length)
        assert len(ref) == n
        shuffle = ds._epoch(epoch)[2]
        assert sorted(shuffle.tolist()) == list(range(n))  # each sample once per epoch
        for k, (tokens, n_real) in enumerate(got):
            want = ref[shuffle[k]]
            assert tokens[:n_real].tolist() == want and n_real == len(want)
            assert (tokens[n_real:] == EOD).all() and len(tokens) == seq_length + 1
    # epochs differ in order, instances with the same seed agree, another seed differs
    assert ds._epoch(0)[2].tolist() != ds._epoch(1)[2].tolist() or n < 3
    again = GPTDataset(
        ix,
        documents=(3, 20),
        seq_length=seq_length,
        seed=5,
        stream="train/0",
        pad=EOD,
        cache_dir=str(tmp_path / "cache"),
    )
    assert all(np.array_equal(again[i][0], ds[i][0]) for i in range(2 * n))
    other = GPTDataset(ix, documents=(3, 20), seq_length=seq_length, seed=6, stream="train/0", pad=EOD)
    assert any(not np.array_equal(other[i][0], ds[i][0]) for i in range(n))


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 6), min_size=0, max_size=3), min_size=1, max_size=12),
    st.integers(1, 9),
    st.integers(0, 3),
)
def test_gpt_samples_property(tmp_path_factory, doc_seq_lengths, seq_length, seed):
    """Any document/sequence lengths (empty ones included): each epoch tiles its token stream."""
    path = str(tmp_path_factory.mktemp("p") / "d")
    docs, value = [], 0
    with IndexedDatasetWriter(path, dtype=np.int32) as w:
        for lengths in doc_seq_lengths:
            seqs = []
            for n in lengths:
                seqs.append(list(range(value, value + n)))
                value += n
            w.add_document(*seqs)
            docs.append([t for q in seqs for t in q])
    ix = IndexedDataset(path)
    if ix.num_tokens < 2:
        with pytest.raises(ValueError, match="at least 2"):
            GPTDataset(ix, documents=(0, len(docs)), seq_length=seq_length, seed=seed, stream="s", pad=-1)
        return
    ds = GPTDataset(ix, documents=(0, len(docs)), seq_length=seq_length, seed=seed, stream="s", pad=-1)
    n = ds.samples_per_epoch
    for epoch in range(2):
        samples = [ds[epoch * n + k] for k in range(n)]
        by_position = [None] * n
        for k, sample in enumerate(samples):
            by_position[ds._epoch(epoch)[2][k]] = sample
        stream = list(by_position[0][0][: by_position[0][1]])
        for tokens, real in by_position[1:]:
            assert tokens[0] == stream[-1]  # consecutive samples share one token
            stream += tokens[1:real].tolist()
        assert all((t[r:] == -1).all() for t, r in by_position)
        assert sorted(stream) == list(range(value))  # every token of the epoch exactly once
        # documents appear whole and contiguous in the stream
        for doc in docs:
            if doc:
                at = stream.index(doc[0])
                assert stream[at : at + len(doc)] == doc


def test_split_ranges_and_parse():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("1") == [1.0, 0.0, 0.0]
    assert split_ranges("8,1,1", 20) == [(0, 16), (16, 18), (18, 20)]
    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    for bad in ("", "1,2,3,4", "-1,2", "0,0,0", "x"):
        with pytest.raises(ValueError, match="data.split"):
            parse_split(bad)


class Counter:
    """Endless dataset whose sample k is just k (to test the blend's bookkeeping)."""

    def __getitem__(self, k):
        return k


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.7, 0.2, 0.1], [1.0, 0.0, 3.0], [0.001, 0.999]])
def test_blend_proportions_and_order(weights):
    blend = BlendedDataset([Counter() for _ in weights], weights, block_size=64)
    m = blend.block_size
    n = 10 * m + 17
    picks = [blend[i] for i in range(n)]
    w = np.asarray(weights) / sum(weights)
    for d in range(len(weights)):
        ks = [k for c, k in picks if c == d]
        assert ks == list(range(len(ks)))  # each component read in order, no gaps
        for b in range(1, 11):  # exact at block boundaries (within 1)
            count = sum(1 for c, _ in picks[: b * m] if c == d)
            assert abs(count - w[d] * b * m) < 1.0 + 1e-9
        if w[d] == 0:
            assert not ks
    # stateless: a fresh instance queried out of order gives the same answers
    fresh = BlendedDataset([Counter() for _ in weights], weights, block_size=64)
    assert [fresh[i] for i in reversed(range(n))] == picks[::-1]


def test_blend_is_evenly_interleaved_inside_a_block():
    blend = BlendedDataset([Counter(), Counter()], [0.75, 0.25], block_size=16)
    comps = [blend[i][0] for i in range(16)]
    # 12 from component 0 and 4 from component 1, the latter spread out (one in every 4)
    assert comps.count(1) == 4 and all(comps[4 * j : 4 * j + 4].count(1) == 1 for j in range(4))


def test_iterator_masks_and_resume(tmp_path):
    make_dataset(str(tmp_path / "d"), n_docs=11)
    ix = IndexedDataset(str(tmp_path / "d"))
    assert (ix.num_tokens - 1) % 8  # this data has a padded last sample
    ds = GPTDataset(ix, documents=(0, 11), seq_length=8, seed=1, stream="train/0", pad=EOD)
    kw = dict(global_batch_size=4, micro_batch_size=2, dp_rank=1, dp_size=2, seq_length=8, eod=EOD)
    it = MicroBatchIterator(ds, **kw)
    mbs = [next(it) for _ in range(6)]
    # dp rank 1 of 2: samples [2, 4) of each global batch of 4, one micro-batch of 2 per step
    assert [mb["sample_index"].tolist() for mb in mbs[:3]] == [[2, 3], [6, 7], [10, 11]]
    n = ds.samples_per_epoch
    for mb in mbs:
        for row, i in enumerate(mb["sample_index"].tolist()):
            tokens, n_real = ds[i]
            assert mb["tokens"][row].tolist() == tokens[:-1].tolist()
            assert mb["labels"][row].tolist() == tokens[1:].tolist()
            assert mb["loss_mask"][row].tolist() == [1.0] * (n_real - 1) + [0.0] * (9 - n_real)
    short = [i for i in range(n) if ds[i][1] < 9]
    assert len(short) == (1 if (ds.num_tokens - 1) % 8 else 0)  # only the epoch's last piece is padded
    for i in short:
        real = ds[i][1]
        assert real < 9 and it.collate([i])["loss_mask"][0].tolist() == [1.0] * (real - 1) + [0.0] * (9 - real)
    it_eod = MicroBatchIterator(ds, eod_mask_loss=True, **kw)
    mb = next(it_eod)
    assert torch.equal(mb["loss_mask"], mbs[0]["loss_mask"] * (mbs[0]["tokens"] != EOD))
    assert (mbs[0]["tokens"] == EOD).any() or (mbs[1]["tokens"] == EOD).any()
    # resume: a state taken after 3 micro-batches continues exactly
    it2 = MicroBatchIterator(ds, **kw)
    for _ in range(3):
        next(it2)
    state = it2.state_dict()
    it3 = MicroBatchIterator(ds, **kw)
    it3.load_state_dict(state)
    assert all(torch.equal(next(it3)["tokens"], mbs[k]["tokens"]) for k in range(3, 6))


def test_mid_step_state_needs_same_batch_sizes(tmp_path):
    make_dataset(str(tmp_path / "d"), n_docs=5)
    ds = GPTDataset(IndexedDataset(str(tmp_path / "d")), documents=(0, 5), seq_length=4, seed=1, stream="t", pad=EOD)
    it = MicroBatchIterator(ds, global_batch_size=4, micro_batch_size=1, dp_rank=0, dp_size=2, seq_length=4, eod=EOD)
    next(it)
    other = MicroBatchIterator(ds, global_batch_size=4, micro_batch_size=1, dp_rank=0, dp_size=4, seq_length=4, eod=EOD)
    with pytest.raises(ValueError, match="middle of a step"):
        other.load_state_dict(it.state_dict())
    with pytest.raises(ValueError, match="global_batch_size=6 is not divisible"):
        MicroBatchIterator(ds, global_batch_size=6, micro_batch_size=1, dp_rank=0, dp_size=4, seq_length=4, eod=EOD)


def _byte_dataset(path, n_docs, base):
    """Document d is (base + d) repeated 3..12 times, then EOD 256: the values name the document."""
    with IndexedDatasetWriter(path, dtype=np.uint16) as w:
        for d in range(n_docs):
            w.add_document([base + d] * (3 + d % 10) + [256])


def test_build_data_blend_and_splits(tmp_path):
    _byte_dataset(str(tmp_path / "a"), 40, 0)
    _byte_dataset(str(tmp_path / "b"), 20, 100)
    cfg = DataConfig(
        paths=[str(tmp_path / "a"), str(tmp_path / "b")],
        weights=[3, 1],
        split="8,1,1",
        cache_dir=str(tmp_path / "cache"),
        blend_block_size=16,
    )
    data = build_data(cfg, seq_length=8, global_batch_size=16, micro_batch_size=4, dp_rank=0, dp_size=1)
    # documents per split: a -> train 0..31, valid 32..35, test 36..39; b -> 0..15, 16..17, 18..19
    allowed = {
        "train": (set(range(0, 32)), set(range(100, 116))),
        "valid": (set(range(32, 36)), set(range(116, 118))),
        "test": (set(range(36, 40)), set(range(118, 120))),
    }
    for name, it in (("train", data.train), ("valid", data.valid), ("test", data.test)):
        comps = []
        for _ in range(16):
            mb = next(it)
            for row in range(4):
                d = int(mb["dataset_index"][row])
                comps.append(d)
                values = set(mb["tokens"][row].tolist() + mb["labels"][row].tolist()) - {256}
                assert values and values <= allowed[name][d], (name, d, values)
        assert comps.count(0) == 48 and comps.count(1) == 16  # 3:1 exactly at block ends
    text = data.describe()
    assert "train:" in text and "docs [0, 32)" in text and "docs [116" not in text and "weight 0.750" in text
    state = data.state_dict()
    assert state["train"]["consumed_samples"] == 64 and state["valid"]["consumed_samples"] == 64
    with pytest.raises(ValueError, match="data.split='98,1,1' gives the 'test' split no documents"):
        build_data(
            DataConfig(paths=[str(tmp_path / "a")], split="98,1,1", cache_dir=str(tmp_path / "cache")),
            seq_length=8,
            global_batch_size=4,
            micro_batch_size=2,
            dp_rank=0,
            dp_size=1,
        )
    assert (
        build_data(
            DataConfig(paths=[str(tmp_path / "a")], split="9,1,0", cache_dir=str(tmp_path / "c")),
            seq_length=8,
            global_batch_size=4,
            micro_batch_size=2,
            dp_rank=0,
            dp_size=1,
        ).test
        is None
    )
    make_dataset(str(tmp_path / "wide"), n_docs=3)
    with pytest.raises(ValueError, match="token ids outside"):  # ids up to 3000 with the byte tokenizer
        build_data(
            DataConfig(paths=[str(tmp_path / "wide")], cache_dir=str(tmp_path / "c")),
            seq_length=8,
            global_batch_size=4,
            micro_batch_size=2,
            dp_rank=0,
            dp_size=1,
        )


def test_default_corpus_is_real_text(tmp_path):
    data = build_data(
        DataConfig(cache_dir=str(tmp_path)),
        seq_length=256,
        global_batch_size=2,
        micro_batch_size=2,
        dp_rank=0,
        dp_size=1,
    )
    assert data.vocab_size == 257 and data.valid is not None and data.test is not None
    mb = next(data.train)
    text = data.tokenizer.decode(mb["tokens"][0].tolist())
    words = text.split()
    assert len(words) > 20 and sum(w.isalpha() for w in words) > len(words) / 3, text
    ix = IndexedDataset(data.prefixes[0])
    assert ix.num_documents > 1000 and ix.num_tokens > 1_000_000
    assert all(int(ix[i][-1]) == 256 for i in range(0, len(ix), 97))  # EOD after every document


def _build_in_child(args):
    final, log = args

    def build(tmp):
        with open(log, "a") as f:
            f.write("built\n")
        with open(os.path.join(tmp, "x"), "w") as f:
            f.write("done")

    return open(os.path.join(build_once(final, build), "x")).read()


def test_build_once_under_concurrency(tmp_path):
    final, log = str(tmp_path / "c" / "thing"), str(tmp_path / "log")
    with mp.get_context("fork").Pool(4) as pool:
        results = pool.map(_build_in_child, [(final, log)] * 8)
    assert results == ["done"] * 8
    assert open(log).read() == "built\n"
    assert sorted(os.listdir(tmp_path / "c")) == ["thing", "thing.lock"]
