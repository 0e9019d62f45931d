"""Data: Megatron-format indexed datasets, tokenizers, splits and blends, exact layout-independent sampling.

Usage::

    from folding.data import DataConfig, build_data
    data = build_data(DataConfig(paths=["/data/web_text_document"]), seq_length=4096,
                      global_batch_size=256, micro_batch_size=1, dp_rank=ps.coords.dp.rank, dp_size=layout.dp)
    mb = next(data.train)     # {"tokens", "labels", "loss_mask", "sample_index", ...}

See docs/data.md for the user guide.
"""

import importlib

_EXPORTS = {
    "BlendedDataset": "blend",
    "parse_split": "blend",
    "split_ranges": "blend",
    "Data": "build",
    "build_data": "build",
    "DataConfig": "config",
    "default_corpus_prefix": "corpus",
    "GPTDataset": "gpt_dataset",
    "IndexedDataset": "indexed",
    "IndexedDatasetError": "indexed",
    "IndexedDatasetWriter": "indexed",
    "MicroBatchIterator": "sampler",
    "ByteTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "build_tokenizer": "tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    # Imported on first use, so that tokenizer worker processes and tools/preprocess_data.py do not
    # pay for importing torch.
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
