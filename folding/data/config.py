"""``DataConfig``: the typed ``data.*`` section of the training configuration.

The entry point converts the Hydra ``data`` node into this dataclass once; :meth:`DataConfig.validate`
runs on construction and names the offending ``data.<field>`` in every error.

Usage::

    cfg = DataConfig(paths=["/data/web_text_document", "/data/code_text_document"],
                     weights=[0.7, 0.3], split="969,30,1", tokenizer="/models/tok", seed=1234)
    DataConfig()       # the embedded default corpus, byte tokenizer
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Union

from .blend import normalize_weights, parse_split


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """Where the training data comes from and how it is cut into samples."""

    paths: List[str] = dataclasses.field(default_factory=list)
    """Dataset prefixes (each names ``PREFIX.bin`` + ``PREFIX.idx``). Empty: the embedded default corpus."""
    weights: Optional[List[float]] = None
    """Blend weights, one per path (normalized to sum 1); ``None`` or empty: equal weights."""
    split: Union[str, Sequence[float]] = "969,30,1"
    """Train, valid, test proportions of every dataset's documents: ``"969,30,1"`` or ``[80, 20, 0]``
    (on the command line ``data.split=80,20,0`` works as is)."""
    tokenizer: str = "byte"
    """``"byte"`` (built-in byte-level, EOD = 256) or the local path of a Hugging Face tokenizer. Must be
    the tokenizer the datasets were written with (it gives the EOD id and ``vocab_size``)."""
    seed: int = 1234
    """Seed of the document and sample shuffles (the same seed gives the same batches on any layout)."""
    cache_dir: Optional[str] = None
    """Where sample indices and the tokenized default corpus are cached; ``None``:
    ``~/.cache/folding/data``. Must be shared by, or identical on, all ranks of a node."""
    eod_mask_loss: bool = False
    """Mask the loss where the input token is EOD (the first token of the next document is not predicted)."""
    shuffle: bool = True
    """Shuffle documents and samples per epoch; ``False`` reads them in file order (for debugging)."""
    blend_block_size: int = 4096
    """Samples per blending block (proportions are exact at every block boundary)."""

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check every field; raises ``ValueError`` naming ``data.<field>`` and a fix."""
        if isinstance(self.paths, str):
            raise ValueError(f"data.paths={self.paths!r} must be a list of prefixes, e.g. [{self.paths!r}]")
        self.paths = [str(p) for p in self.paths]
        for p in self.paths:
            if p.endswith(".bin") or p.endswith(".idx"):
                raise ValueError(f"data.paths entry {p!r} must be a prefix without .bin/.idx, e.g. {p[:-4]!r}")
        if self.weights:
            if not self.paths:
                raise ValueError(
                    "data.weights is set but data.paths is empty; give the paths to blend or clear data.weights"
                )
            normalize_weights(self.weights, len(self.paths))
        parse_split(self.split)
        if isinstance(self.split, (list, tuple)):  # one spelling for the cache keys and the saved config
            self.split = ",".join(f"{float(x):g}" for x in self.split)
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ValueError(f"data.tokenizer={self.tokenizer!r} must be 'byte' or a local tokenizer path")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"data.seed={self.seed!r} must be an integer")
        if (
            isinstance(self.blend_block_size, bool)
            or not isinstance(self.blend_block_size, int)
            or self.blend_block_size < 1
        ):
            raise ValueError(f"data.blend_block_size={self.blend_block_size!r} must be an integer >= 1")
