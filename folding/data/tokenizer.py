"""Tokenizers: a built-in byte-level tokenizer and Hugging Face tokenizers loaded from a local path.

``data.tokenizer`` is either ``"byte"`` or a path (a directory written by ``save_pretrained`` or a
``tokenizer.json`` file). Nothing is downloaded: a path that does not exist is an error.

Every tokenizer exposes ``encode(text) -> list[int]`` (no special tokens added), ``decode(ids)``,
``eod`` (the end-of-document id appended between documents), ``vocab_size`` (ids are in
``[0, vocab_size)``; padding the embedding table to a multiple of 128 is the model's business) and
``fingerprint`` (a short string that changes whenever the token ids would; used in cache keys).

Usage::

    tok = build_tokenizer("byte")            # 256 byte ids + EOD = 256
    tok.encode("hé")                         # [104, 195, 169]
    tok = build_tokenizer("/models/my-tokenizer")
"""

from __future__ import annotations

import hashlib
import os
from typing import List, Sequence


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus ``EOD = 256``; ``vocab_size = 257``."""

    name = "byte"
    eod = 256
    vocab_size = 257
    fingerprint = "byte-v1"

    def encode(self, text: str) -> List[int]:
        """The UTF-8 bytes of ``text`` as ids."""
        return list(text.encode("utf-8"))

    def encode_bytes(self, text: str) -> bytes:
        """The UTF-8 bytes of ``text`` (fast path for array construction)."""
        return text.encode("utf-8")

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text (EOD becomes a newline; invalid UTF-8 is replaced)."""
        return bytes(10 if i == self.eod else int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer from a local path, via ``transformers`` (no network access).

    ``eod`` is the tokenizer's EOS token (or its ``<|endoftext|>``-style special token); a tokenizer
    with neither is rejected. ``vocab_size`` is ``len(tokenizer)`` (base vocabulary plus added tokens).
    """

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        try:
            from transformers import AutoTokenizer, PreTrainedTokenizerFast
        except ImportError as e:  # pragma: no cover - transformers is a declared extra
            raise ImportError(
                f"data.tokenizer={path!r} needs the 'transformers' package: pip install 'folding[hf]'"
            ) from e
        if os.path.isfile(self.path):
            self._tok = PreTrainedTokenizerFast(tokenizer_file=self.path)
        else:
            self._tok = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        eod = self._tok.eos_token_id
        if eod is None:
            for candidate in ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>"):
                tid = self._tok.convert_tokens_to_ids(candidate)
                if isinstance(tid, int) and tid != self._tok.unk_token_id and tid is not None:
                    eod = tid
                    break
        if eod is None:
            raise ValueError(
                f"tokenizer at data.tokenizer={path!r} has no EOS token to mark document "
                f"ends; set eos_token in its tokenizer_config.json"
            )
        self.eod = int(eod)
        self.vocab_size = len(self._tok)
        self.name = self.path
        h = hashlib.sha256()
        files = (
            [self.path]
            if os.path.isfile(self.path)
            else sorted(os.path.join(self.path, f) for f in os.listdir(self.path))
        )
        for fp in files:
            if os.path.isfile(fp):
                h.update(os.path.basename(fp).encode())
                with open(fp, "rb") as f:
                    h.update(f.read())
        self.fingerprint = "hf-" + h.hexdigest()[:16]

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text`` without special tokens (EOD is appended by the caller)."""
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """Ids back to text."""
        return self._tok.decode(list(int(i) for i in ids))


def build_tokenizer(spec: str):
    """``"byte"`` -> :class:`ByteTokenizer`; an existing local path -> :class:`HFTokenizer`.

    Raises ``FileNotFoundError`` naming ``data.tokenizer`` when the path does not exist.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"data.tokenizer={spec!r} must be 'byte' or a local tokenizer path")
    if spec == "byte":
        return ByteTokenizer()
    if not os.path.exists(spec):
        raise FileNotFoundError(
            f"data.tokenizer={spec!r} (--tokenizer of tools/preprocess_data.py): no such file or "
            f"directory; give 'byte' or the path of a "
            f"tokenizer saved with save_pretrained (a directory) or a tokenizer.json file"
        )
    return HFTokenizer(spec)
