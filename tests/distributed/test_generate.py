"""``examples/generate.py`` on a tiny checkpoint of the trainer (1 rank, 2 steps on the default data).

Its greedy continuation of a prompt, from the checkpoint and from the checkpoint exported to Hugging
Face, equals transformers' own greedy ``generate`` with the exported weights (restricted to the byte
tokenizer's ids, stopping at its end-of-document id); sampling is reproducible from its seed, and
top-k 1 sampling is greedy.
"""

import importlib.util
import os
import subprocess
import sys

import torch

from folding.checkpoint.load import latest_complete, read_meta
from folding.data.tokenizer import ByteTokenizer
from tests.distributed.test_checkpoint_reshard import _job, _run
from tests.optional import require

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "generate.py")
PROMPT, NEW = "The model ", 12


def _train_tiny(root):
    _run(_job({}, False, steps=2, ckpt_dir=os.path.join(root, "ck")), os.path.join(root, "run"))


def _example():
    spec = importlib.util.spec_from_file_location("generate_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generate(capsys, path, *args):
    assert _example().main([path, "--prompt", PROMPT, "--max-new-tokens", str(NEW), *args]) == 0
    return capsys.readouterr().out


def _hf_greedy(transformers, hf_dir):
    """What transformers generates greedily from the exported ``hf_dir`` after ``PROMPT``, as
    ``examples/generate.py`` prints it (prompt, continuation up to the end-of-document token, newline)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tok = ByteTokenizer()
    ids = torch.tensor([tok.encode(PROMPT)])
    out = hf.generate(
        ids,
        max_new_tokens=NEW,
        do_sample=False,
        eos_token_id=tok.eod,
        pad_token_id=tok.eod,
        suppress_tokens=list(range(tok.vocab_size, hf.config.vocab_size)),
    )[0, ids.shape[1] :].tolist()
    new = out[: out.index(tok.eod)] if tok.eod in out else out
    assert new, "transformers generated nothing: the comparison would be empty"
    return PROMPT + tok.decode(new) + "\n"


def test_generate_from_checkpoint_and_hf_directory(ranks, tmp_path, capsys):
    transformers = require("transformers")
    from tools import convert_hf

    ranks(1).run(_train_tiny, str(tmp_path))
    ck, hf_dir = str(tmp_path / "ck"), str(tmp_path / "hf")
    assert convert_hf.main(["export", "--checkpoint", ck, "--out", hf_dir]) == 0
    capsys.readouterr()

    want = _hf_greedy(transformers, hf_dir)

    assert _generate(capsys, ck) == want
    assert _generate(capsys, hf_dir) == want
    sampled = _generate(capsys, ck, "--temperature", "0.8", "--top-k", "20", "--seed", "3")
    assert sampled.startswith(PROMPT) and sampled == _generate(
        capsys, ck, "--temperature", "0.8", "--top-k", "20", "--seed", "3"
    )
    assert _generate(capsys, ck, "--temperature", "1.0", "--top-k", "1", "--seed", "5") == want
    # and as a script, from the command line
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cli = subprocess.run(
        [sys.executable, SCRIPT, ck, "--prompt", PROMPT, "--max-new-tokens", str(NEW)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0 and cli.stdout == want, cli.stderr[-2000:]


def _train_with_replicas(root):
    moe = dict(expert_replicas=2, replica_interval=1)  # re-planned every step: the slots are in use
    _run(_job(dict(ep=4, etp=1), False, steps=2, ckpt_dir=os.path.join(root, "ck"), moe=moe), os.path.join(root, "run"))


def test_checkpoint_trained_with_replicas_exports_and_generates(ranks, tmp_path, capsys):
    """Training-only options (here hot-expert replicas, 4 ranks EP4) stop neither export nor sampling:
    both build the model without them, and the exported model generates in transformers what
    ``examples/generate.py`` generates from the checkpoint."""
    transformers = require("transformers")
    from tools import convert_hf

    ranks(4).run(_train_with_replicas, str(tmp_path))
    ck, hf_dir = str(tmp_path / "ck"), str(tmp_path / "hf")
    saved = read_meta(latest_complete(ck))
    assert saved["model"]["moe"]["expert_replicas"] == 2  # the checkpoint remembers how it trained
    assert convert_hf.main(["export", "--checkpoint", ck, "--out", hf_dir]) == 0
    capsys.readouterr()
    assert _generate(capsys, ck) == _hf_greedy(transformers, hf_dir)
    sampled = _generate(capsys, ck, "--temperature", "0.8", "--top-k", "20", "--seed", "3")
    assert sampled.startswith(PROMPT) and len(sampled) > len(PROMPT) + 1
