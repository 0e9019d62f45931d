"""Tokenize a JSON-lines or plain-text file into a Megatron-format indexed dataset (PREFIX.bin + PREFIX.idx).

The output reads unchanged in Megatron-LM, and Megatron-LM's outputs read unchanged here. A ``.txt``
file is plain text: one document per line when it has no blank lines between its lines (Megatron's
JSONL rule, and the common form), else one per blank-line separated paragraph (``--text-split
paragraph``, ``line`` or ``file`` choose; the summary says which was used).

Usage::

    python -m tools.preprocess_data --input docs.jsonl --output-prefix data/docs --tokenizer byte --append-eod
    python -m tools.preprocess_data --input book.txt --output-prefix data/book --append-eod
    python -m tools.preprocess_data --input docs.jsonl.gz --output-prefix data/docs \\
        --tokenizer /models/qwen2-tokenizer --json-key content --workers 8 --append-eod

Then train on it with ``data.paths=[data/docs]`` and the same ``data.tokenizer``.
"""

import argparse
import sys

from folding.data.preprocess import INPUT_FORMATS, TEXT_SPLITS, preprocess_jsonl


def main(argv=None) -> int:
    """Parse the command line, run the tokenization, print a summary; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--input", required=True, help="JSON-lines file, one document per line, or plain text (.txt); optionally .gz"
    )
    p.add_argument(
        "--input-format",
        default="auto",
        choices=INPUT_FORMATS,
        help="jsonl or text (default auto: text for .txt/.txt.gz, else jsonl)",
    )
    p.add_argument(
        "--text-split",
        default="auto",
        choices=TEXT_SPLITS,
        help="plain text: auto (default: one document per line when the file has no blank lines between "
        "its lines, else per paragraph), paragraph (blank-line separated), line or file",
    )
    p.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx")
    p.add_argument(
        "--tokenizer", default="byte", help="'byte' (built-in byte-level) or the local path of a Hugging Face tokenizer"
    )
    p.add_argument("--json-key", default="text", help="key of the text in each JSON object (default: text)")
    p.add_argument("--append-eod", action="store_true", help="append the EOD token after every document")
    p.add_argument("--workers", type=int, default=1, help="tokenizer worker processes (default: 1)")
    p.add_argument("--dtype", default=None, help="token dtype (default: uint16 if the vocabulary fits, else int32)")
    p.add_argument("--no-progress", action="store_true", help="do not draw the progress line")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers={args.workers} must be >= 1")
    try:
        stats = preprocess_jsonl(
            args.input,
            args.output_prefix,
            tokenizer=args.tokenizer,
            json_key=args.json_key,
            append_eod=args.append_eod,
            workers=args.workers,
            progress=not args.no_progress,
            dtype=args.dtype,
            input_format=args.input_format,
            text_split=args.text_split,
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    split = stats.get("text_split")
    per = f" (one per {split}{', --text-split auto' if args.text_split == 'auto' else ''})" if split else ""
    print(
        f"wrote {args.output_prefix}.bin and {args.output_prefix}.idx: {stats['documents']} documents{per}, "
        f"{stats['tokens']} tokens, dtype {stats['dtype']}, vocab_size {stats['vocab_size']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
