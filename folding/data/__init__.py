"""Data: Megatron-format indexed datasets, tokenizers, splits and blends, exact layout-independent sampling.

Usage::

    from folding.data import DataConfig, build_data
    data = build_data(DataConfig(paths=["/data/web_text_document"]), seq_length=4096,
                      global_batch_size=256, micro_batch_size=1, dp_rank=ps.dp_rank, dp_size=layout.dp)
    mb = next(data.train)     # {"tokens", "labels", "loss_mask", "sample_index", ...}

See docs/data.md for the user guide.
"""
from .blend import BlendedDataset, parse_split, split_ranges
from .build import Data, build_data
from .config import DataConfig
from .corpus import default_corpus_prefix
from .gpt_dataset import GPTDataset
from .indexed import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter
from .sampler import MicroBatchIterator
from .tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

__all__ = ["BlendedDataset", "ByteTokenizer", "Data", "DataConfig", "GPTDataset", "HFTokenizer",
           "IndexedDataset", "IndexedDatasetError", "IndexedDatasetWriter", "MicroBatchIterator",
           "build_data", "build_tokenizer", "default_corpus_prefix", "parse_split", "split_ranges"]
