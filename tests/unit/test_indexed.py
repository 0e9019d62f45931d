"""Megatron-format indexed datasets: writer, reader, preprocessing tool, and the corrupt-file errors.

The reference reader below is written from the format description alone (magic, version, dtype code,
counts, int32 lengths, int64 byte pointers, int64 document index), independently of
folding.data.indexed, so that writer and reader cannot agree on a private mistake.
"""

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from folding.data import DataConfig, IndexedDataset, IndexedDatasetError, IndexedDatasetWriter, build_data
from folding.data.preprocess import preprocess_jsonl
from folding.data.tokenizer import ByteTokenizer, build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Megatron-LM's dtype codes, as documented for its MMIDIDX index format.
MEGATRON_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


def reference_read(prefix):
    """Independent reader: returns (dtype, sequences as lists, document index as a list)."""
    with open(prefix + ".idx", "rb") as f:
        raw = f.read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", raw, 9)
    assert version == 1
    dtype = np.dtype(MEGATRON_CODES[raw[17]])
    n_seq, n_doc = struct.unpack_from("<QQ", raw, 18)
    pos = 34
    lengths = struct.unpack_from(f"<{n_seq}i", raw, pos)
    pos += 4 * n_seq
    pointers = struct.unpack_from(f"<{n_seq}q", raw, pos)
    pos += 8 * n_seq
    docs = struct.unpack_from(f"<{n_doc}q", raw, pos)
    pos += 8 * n_doc
    assert pos == len(raw)
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    seqs = []
    for length, ptr in zip(lengths, pointers):
        seqs.append(np.frombuffer(data[ptr : ptr + length * dtype.itemsize], dtype=dtype).tolist())
    return dtype, seqs, list(docs)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.int64, np.float64, np.float32, np.uint16])
def test_writer_matches_reference_reader_every_dtype(tmp_path, dtype):
    rng = np.random.default_rng(3)
    hi = 100 if np.dtype(dtype).itemsize == 1 else 30000
    docs = [
        [rng.integers(0, hi, size=rng.integers(0, 9)).astype(dtype) for _ in range(rng.integers(1, 4))]
        for _ in range(7)
    ]
    prefix = str(tmp_path / "ds")
    with IndexedDatasetWriter(prefix, dtype=dtype) as w:
        for doc in docs:
            w.add_document(*doc)
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]
    flat = [s.tolist() for doc in docs for s in doc]
    bounds = np.cumsum([0] + [len(d) for d in docs]).tolist()
    ref_dtype, ref_seqs, ref_docs = reference_read(prefix)
    assert ref_dtype == np.dtype(dtype) and ref_seqs == flat and ref_docs == bounds
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype) and len(ds) == len(flat) and ds.num_documents == len(docs)
    assert [ds[i].tolist() for i in range(len(ds))] == flat
    assert ds.document_indices.tolist() == bounds
    assert [s.tolist() for s in ds.document(3)] == [s.tolist() for s in docs[3]]
    k = max(range(len(flat)), key=lambda i: len(flat[i]))
    assert ds.get(k, 1, 2).tolist() == flat[k][1:3]


def reference_write(prefix, dtype_code, sequences, doc_index):
    """Independent writer from the format description (the layout Megatron-LM's preprocessing writes)."""
    dtype = np.dtype(MEGATRON_CODES[dtype_code])
    lengths = [len(s) for s in sequences]
    pointers = [0]
    for n in lengths[:-1]:
        pointers.append(pointers[-1] + n * dtype.itemsize)
    with open(prefix + ".bin", "wb") as f:
        for seq in sequences:
            f.write(np.asarray(seq, dtype=dtype).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", dtype_code))
        f.write(struct.pack("<QQ", len(sequences), len(doc_index)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_index)}q", *doc_index))


@pytest.mark.parametrize("code", sorted(MEGATRON_CODES))
def test_reader_reads_reference_writer(tmp_path, code):
    # 3 documents: one sequence, two sequences (sentence-split), one empty sequence
    seqs = [[1, 2, 3], [4, 5], [6, 7, 8, 9], []]
    prefix = str(tmp_path / "mega")
    reference_write(prefix, code, seqs, [0, 1, 3, 4])
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(MEGATRON_CODES[code]) and len(ds) == 4 and ds.num_documents == 3
    assert [ds[i].tolist() for i in range(4)] == seqs and ds.num_tokens == 9
    assert [[s.tolist() for s in ds.document(d)] for d in range(3)] == [[seqs[0]], seqs[1:3], [[]]]


def test_writer_rejects_tokens_that_do_not_fit(tmp_path):
    w = IndexedDatasetWriter(str(tmp_path / "x"), dtype=np.uint16)
    with pytest.raises(ValueError, match="uint16"):
        w.add_sequence(np.array([1, 70000], np.int64))


def _jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t, "other": 1}) + "\n")


TEXTS = ["Hello, world.", "", "Ünïcödé – text with 漢字 and emoji 🙂", "a" * 300, "line\nbreaks\tand tabs"]


def test_preprocess_tool_roundtrip_byte(tmp_path):
    src = tmp_path / "in.jsonl"
    _jsonl(src, TEXTS, key="body")
    prefix = str(tmp_path / "out" / "docs")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.preprocess_data",
            "--input",
            str(src),
            "--output-prefix",
            prefix,
            "--tokenizer",
            "byte",
            "--json-key",
            "body",
            "--append-eod",
            "--workers",
            "2",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert r.returncode == 0, r.stderr
    assert "5 documents" in r.stdout and "uint16" in r.stdout
    tok = ByteTokenizer()
    expected = [list(t.encode("utf-8")) + [tok.eod] for t in TEXTS]
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    dtype, seqs, docs = reference_read(prefix)
    assert dtype == np.uint16 and seqs == expected and docs == list(range(len(TEXTS) + 1))
    assert tok.decode(ds[2][:-1]) == TEXTS[2]
    # the worker count does not change the output
    stats = preprocess_jsonl(str(src), str(tmp_path / "one"), json_key="body", append_eod=True, workers=1)
    assert stats["documents"] == 5
    for ext in (".bin", ".idx"):
        assert open(prefix + ext, "rb").read() == open(str(tmp_path / "one") + ext, "rb").read()


def test_preprocess_tool_errors_name_the_file(tmp_path):
    tool = ["-m", "tools.preprocess_data"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run(
        [sys.executable, *tool, "--input", str(tmp_path / "absent.jsonl"), "--output-prefix", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 2 and "absent.jsonl" in r.stderr, r.stderr
    _jsonl(tmp_path / "in.jsonl", ["x"])
    r = subprocess.run(
        [
            sys.executable,
            *tool,
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output-prefix",
            str(tmp_path / "o"),
            "--tokenizer",
            str(tmp_path / "no-tok"),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 2 and "data.tokenizer" in r.stderr and "no-tok" in r.stderr, r.stderr


def _save_hf_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(TEXTS * 20 + ["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>").save_pretrained(path)
    tk.save(os.path.join(path, "raw-tokenizer.json"))


def test_preprocess_roundtrip_hf_tokenizer(tmp_path):
    tok_dir = str(tmp_path / "tok")
    _save_hf_tokenizer(tok_dir)
    src = tmp_path / "in.jsonl"
    _jsonl(src, TEXTS)
    prefix = str(tmp_path / "hf")
    stats = preprocess_jsonl(str(src), prefix, tokenizer=tok_dir, append_eod=True, workers=1)
    tok = build_tokenizer(tok_dir)
    assert tok.eod == tok._tok.convert_tokens_to_ids("<eos>") and stats["vocab_size"] == tok.vocab_size
    expected = [tok.encode(t) + [tok.eod] for t in TEXTS]
    assert any(len(e) - 1 < len(t.encode()) for e, t in zip(expected, TEXTS))  # real merges happened
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert reference_read(prefix)[1] == expected
    assert tok.decode(ds[0][:-1]) == TEXTS[0]
    # a bare tokenizer.json file works too and gives the same ids
    raw = build_tokenizer(os.path.join(tok_dir, "raw-tokenizer.json"))
    assert raw.encode(TEXTS[2]) == tok.encode(TEXTS[2]) and raw.fingerprint != tok.fingerprint


# ---- bad input: each error names the file (or the setting) --------------------------------------


@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "good")
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as w:
        for n in (5, 3, 8):
            w.add_document(np.arange(n))
    return prefix


def _raises(prefix, *needles):
    with pytest.raises(IndexedDatasetError) as e:
        IndexedDataset(prefix)
    for n in needles:
        assert n in str(e.value), str(e.value)
    return str(e.value)


def test_missing_files(good):
    os.remove(good + ".bin")
    _raises(good, good + ".bin", "does not exist")
    os.remove(good + ".idx")
    _raises(good, good + ".idx", "does not exist")


def test_truncated_bin_and_idx(good):
    data = open(good + ".bin", "rb").read()
    open(good + ".bin", "wb").write(data[:-2])
    _raises(good, good + ".bin", "truncated")
    open(good + ".bin", "wb").write(data)
    idx = open(good + ".idx", "rb").read()
    open(good + ".idx", "wb").write(idx[:-8])
    _raises(good, good + ".idx", "truncated")
    open(good + ".idx", "wb").write(idx[:20])
    _raises(good, good + ".idx", "truncated")


def test_wrong_magic_version_and_dtype(good):
    idx = bytearray(open(good + ".idx", "rb").read())
    bad = bytearray(idx)
    bad[0:3] = b"XYZ"
    open(good + ".idx", "wb").write(bad)
    _raises(good, good + ".idx", "magic")
    bad = bytearray(idx)
    bad[9:17] = struct.pack("<Q", 2)
    open(good + ".idx", "wb").write(bad)
    _raises(good, good + ".idx", "version 2")
    bad = bytearray(idx)
    bad[17] = 9
    open(good + ".idx", "wb").write(bad)
    _raises(good, good + ".idx", "dtype code 9")
    bad = bytearray(idx)
    bad[34 + 3 * 4 + 8 : 34 + 3 * 4 + 16] = struct.pack("<q", 4)  # 2nd pointer
    open(good + ".idx", "wb").write(bad)
    _raises(good, good + ".idx", "pointers")
    bad = bytearray(idx)
    bad[34 + 3 * 4 + 3 * 8 + 8 : 34 + 3 * 4 + 3 * 8 + 16] = struct.pack("<q", 5)
    open(good + ".idx", "wb").write(bad)
    _raises(good, good + ".idx", "document index")
    bad = bytearray(idx)
    bad[17] = 4  # int32 instead of uint16: .bin size no longer matches
    open(good + ".idx", "wb").write(bad)
    _raises(good, good + ".bin", "int32")


def test_config_and_tokenizer_errors(tmp_path, good):
    with pytest.raises(ValueError, match="data.weights has 1 entries but data.paths has 2"):
        DataConfig(paths=[good, good], weights=[1.0])
    with pytest.raises(ValueError, match="data.split"):
        DataConfig(split="a,b")
    with pytest.raises(ValueError, match="data.paths"):
        DataConfig(paths=[good + ".bin"])
    missing = str(tmp_path / "no-such-tokenizer")
    with pytest.raises(FileNotFoundError, match="data.tokenizer=.*no-such-tokenizer"):
        build_tokenizer(missing)
    with pytest.raises(FileNotFoundError, match="data.tokenizer"):
        build_data(
            DataConfig(paths=[good], tokenizer=missing),
            seq_length=4,
            global_batch_size=1,
            micro_batch_size=1,
            dp_rank=0,
            dp_size=1,
        )
    with pytest.raises(IndexedDatasetError, match="nope.idx"):
        build_data(
            DataConfig(paths=[str(tmp_path / "nope")], cache_dir=str(tmp_path)),
            seq_length=4,
            global_batch_size=1,
            micro_batch_size=1,
            dp_rank=0,
            dp_size=1,
        )


def test_empty_corpus_errors(tmp_path):
    src = tmp_path / "empty.jsonl"
    src.write_text("\n\n")
    with pytest.raises(ValueError, match="empty.jsonl holds no documents"):
        preprocess_jsonl(str(src), str(tmp_path / "e"))
    assert not os.path.exists(str(tmp_path / "e.bin")) and not os.path.exists(str(tmp_path / "e.idx"))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        preprocess_jsonl(str(tmp_path / "missing.jsonl"), str(tmp_path / "m"))
    src.write_text('{"title": "no text key"}\n')
    with pytest.raises(ValueError, match="line 1.*'text'"):
        preprocess_jsonl(str(src), str(tmp_path / "e"))
    prefix = str(tmp_path / "zero")
    with IndexedDatasetWriter(prefix) as w:
        w.add_document([])
    with pytest.raises(ValueError, match="zero .*holds no tokens"):
        build_data(
            DataConfig(paths=[prefix], cache_dir=str(tmp_path)),
            seq_length=4,
            global_batch_size=1,
            micro_batch_size=1,
            dp_rank=0,
            dp_size=1,
        )


def test_preprocess_plain_text_paragraphs_lines_and_file(tmp_path):
    from folding.data.indexed import IndexedDataset

    src = tmp_path / "notes.txt"
    src.write_text("first para\nstill first\n\n\nsecond\n\nthird\n")
    counts = {}
    for split, workers in (("paragraph", 1), ("paragraph", 2), ("line", 1), ("file", 1)):
        prefix = str(tmp_path / f"{split}{workers}")
        stats = preprocess_jsonl(str(src), prefix, text_split=split, workers=workers)
        ds = IndexedDataset(prefix)
        docs = [bytes(ds[i].astype("uint8").tolist()).decode() for i in range(len(ds))]
        counts[(split, workers)] = (stats["documents"], docs)
    assert counts[("paragraph", 1)] == (3, ["first para\nstill first", "second", "third"])
    assert counts[("paragraph", 2)] == counts[("paragraph", 1)]
    assert counts[("line", 1)] == (4, ["first para", "still first", "second", "third"])
    assert counts[("file", 1)] == (1, ["first para\nstill first\n\n\nsecond\n\nthird"])
    with pytest.raises(ValueError, match="for plain text use a .txt file or --input-format text"):
        (tmp_path / "notes.jsonl").write_text("just words\n")
        preprocess_jsonl(str(tmp_path / "notes.jsonl"), str(tmp_path / "j"))
    assert preprocess_jsonl(str(tmp_path / "notes.jsonl"), str(tmp_path / "j"), input_format="text")["documents"] == 1


def test_plain_text_form_is_detected(tmp_path):
    from folding.data.preprocess import detect_text_split

    cases = {
        "per_line.txt": ("\n\none\ntwo\nthree\n\n\n", "line", 3),  # blank lines only at the ends
        "paragraphs.txt": ("one\nstill one\n\ntwo\n", "paragraph", 2),
        "spaces.txt": ("one\n   \ntwo\n", "paragraph", 2),  # a whitespace-only line is blank
    }
    for name, (text, form, docs) in cases.items():
        (tmp_path / name).write_text(text)
        assert detect_text_split(str(tmp_path / name)) == form, name
        stats = preprocess_jsonl(str(tmp_path / name), str(tmp_path / name[:-4]))  # the default: auto
        assert (stats["text_split"], stats["documents"]) == (form, docs), name
