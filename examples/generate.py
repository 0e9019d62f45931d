"""Sample text from a training checkpoint or a Hugging Face model directory (one process).

    python examples/generate.py ckpt/run1 --prompt "Once upon a time"                  # greedy
    python examples/generate.py ckpt/run1/step_00000060 --prompt "The" --temperature 0.8 --top-k 40 --seed 1
    python examples/generate.py hf_out --prompt "The" --tokenizer /models/my-tokenizer

PATH is a checkpoint of the trainer (``step_<N>``, or a directory of them: its latest complete one,
saved in any layout) or a Hugging Face directory (``config.json`` + safetensors, e.g. from
``tools/convert_hf.py export`` or ``save_pretrained``). The prompt goes through the data pipeline's
tokenizer (``folding.data.tokenizer.build_tokenizer``): ``--tokenizer``, else the ``data.tokenizer``
the checkpoint was trained with, else the Hugging Face directory itself when it holds a tokenizer,
else the byte tokenizer. Only ids of that tokenizer are sampled; generation stops at its end-of-document
id or after ``--max-new-tokens``. ``--temperature 0`` (the default) is greedy; otherwise tokens are
drawn from ``softmax(logits / temperature)`` over the ``--top-k`` most likely (all when unset). Each
new token reruns the whole sequence (no KV cache): this is for the small models one trains here.
"""

import argparse
import os
import sys

import torch

from folding.checkpoint.load import is_complete, latest_complete, load_full_model, read_meta
from folding.data.tokenizer import build_tokenizer
from folding.model.config import ModelConfig
from folding.model.hf.weights import from_hf
from folding.model.transformer import MoETransformer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load(path: str, tokenizer=None):
    """``(model in eval mode, tokenizer)`` for a checkpoint or a Hugging Face directory ``path``."""
    if os.path.isfile(os.path.join(path, "config.json")):
        model = from_hf(path)
        own = any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES)
        default = path if own else "byte"
    else:
        ckpt = path if is_complete(path) else latest_complete(path)
        if ckpt is None:
            raise SystemExit(f"error: {path} is neither a Hugging Face directory nor a (directory of) checkpoint(s)")
        meta = read_meta(ckpt)
        model = MoETransformer(ModelConfig.from_dict(meta["model"]).for_inference(), initialize=False)
        load_full_model(ckpt, model)
        default = meta.get("tokenizer") or "byte"
    return model.eval(), build_tokenizer(tokenizer or default)


@torch.no_grad()
def generate(model, ids, *, max_new_tokens, vocab_size, eod=None, temperature=0.0, top_k=None, generator=None):
    """The ids that ``model`` appends to the prompt ``ids`` (ids below ``vocab_size`` only; stops
    after ``eod``, which is not returned)."""
    ids, out = list(ids), []
    window = model.config.max_position_embeddings
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids[-window:]]))[0, -1, :vocab_size].float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            if top_k:
                kth = torch.topk(logits, min(top_k, vocab_size)).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
        if nxt == eod:
            break
        ids.append(nxt)
        out.append(nxt)
    return out


def main(argv=None) -> int:
    """Parse the arguments, sample, print the prompt and its continuation."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("path", help="checkpoint (step_<N> or a directory of them) or Hugging Face directory")
    p.add_argument("--prompt", default="", help="text to continue (empty: start from the end-of-document id)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely ids")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--tokenizer", default=None, help="'byte' or a tokenizer path (default: see above)")
    a = p.parse_args(argv)
    model, tok = load(a.path, a.tokenizer)
    if tok.vocab_size > model.config.vocab_size:
        raise SystemExit(f"error: the tokenizer has {tok.vocab_size} ids, the model {model.config.vocab_size}")
    ids = tok.encode(a.prompt) or [tok.eod]
    new = generate(
        model,
        ids,
        max_new_tokens=a.max_new_tokens,
        vocab_size=tok.vocab_size,
        eod=tok.eod,
        temperature=a.temperature,
        top_k=a.top_k,
        generator=torch.Generator().manual_seed(a.seed),
    )
    print(a.prompt + tok.decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
