"""Turn a Megatron-LM training command line into this engine's Hydra overrides.

Usage::

    python -m tools.megatron_args --tensor-model-parallel-size 2 --expert-model-parallel-size 4 ...
    python -m tools.megatron_args torchrun --nproc_per_node 8 --nnodes 8 pretrain_gpt.py --num-layers 32 ...
    python -m tools.megatron_args --one-line --world-size 64 --num-layers 32 ...   # one command to run
    python examples/pretrain_mixtral.py $(python -m tools.megatron_args ... ) train.dry_run=true

Give the flags of Megatron-LM's ``pretrain_gpt.py``, optionally after the launcher (``torchrun ...
pretrain_gpt.py``: its ``--nproc_per_node`` x ``--nnodes`` become ``parallel.world_size``). The
overrides go to stdout one per line (``--one-line``: as one ``examples/pretrain_mixtral.py`` command);
notes on what is accepted but differs or changes nothing go to stderr, each line starting with ``#``.
A flag without an equivalent here is refused by name: exit status 2 and one ``error:`` line listing
them. The table of flags and keys is in docs/megatron.md (and
:data:`folding.interop.megatron.flags.FLAGS`).

The tool's own options come first: ``--world-size N`` (the ranks, when no launcher is given),
``--one-line``, ``--only-given`` (convert only the flags given, without Megatron-LM's defaults for the
keys they leave out).
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import List, Optional, Tuple

from folding.interop.megatron.args import MegatronArgsError, convert

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
OWN = ("--world-size", "--one-line", "--only-given", "--help", "-h")
LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


def split_launcher(argv: List[str]) -> Tuple[List[str], Optional[int], List[str]]:
    """``(launcher tokens, its world size or None, Megatron-LM flags)``: a leading ``torchrun ...
    script.py`` (or ``python -m torch.distributed.run ... script.py``) is cut off, its
    ``--nproc_per_node`` x ``--nnodes`` read; a bare leading ``*.py`` script is dropped."""
    if not argv:
        return [], None, []
    if argv[0].endswith(".py"):
        return [], None, argv[1:]
    is_launcher = os.path.basename(argv[0]) in LAUNCHERS or (len(argv) > 2 and argv[1] == "-m" and argv[2] in LAUNCHERS)
    if not is_launcher:
        return [], None, argv
    script = next((i for i, t in enumerate(argv) if t.endswith(".py")), None)
    if script is None:
        raise MegatronArgsError([f"{argv[0]} ...: no training script (*.py) after the launcher"], [])
    launcher, sizes = argv[:script], {}
    for i, tok in enumerate(launcher):
        name, eq, val = tok.partition("=")
        name = name.replace("_", "-")
        if name in ("--nproc-per-node", "--nnodes"):
            sizes[name] = val if eq else (launcher[i + 1] if i + 1 < len(launcher) else "")
    world = None
    try:
        world = int(sizes.get("--nproc-per-node", "1")) * int(sizes.get("--nnodes", "1"))
    except ValueError:  # "gpu", "auto" or an elastic range: the launched world decides
        world = None
    return launcher, world, argv[script + 1 :]


def main(argv=None) -> int:
    """Print the overrides; 0, or 2 with one ``error:`` line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    world, one_line, only_given = None, False, False
    while argv and argv[0].split("=")[0] in OWN:
        tok = argv.pop(0)
        name, eq, val = tok.partition("=")
        if name in ("--help", "-h"):
            print(__doc__)
            return 0
        if name == "--one-line":
            one_line = True
        elif name == "--only-given":
            only_given = True
        else:
            if not eq:
                val = argv.pop(0) if argv else ""
            if not val.isdigit() or int(val) < 1:
                print(f"error: --world-size {val!r}: give the number of ranks, e.g. --world-size 64", file=sys.stderr)
                return 2
            world = int(val)
    try:
        launcher, launched, flags = split_launcher(argv)
        if not flags:
            raise MegatronArgsError(["no Megatron-LM flags given (python -m tools.megatron_args --help)"], [])
        result = convert(flags, world_size=world or launched, config_dir=None if only_given else CONFIGS)
    except MegatronArgsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in result.notes:
        print(f"# {note}", file=sys.stderr)
    if one_line:
        head = ["python", "examples/pretrain_mixtral.py"]
        if launcher:
            head = ["torchrun", *[t for t in launcher[1:] if not t.startswith(("-m", "torch.distributed"))]]
            head.append("examples/pretrain_mixtral.py")
        print(" ".join(shlex.quote(t) for t in head + result.overrides))
    else:
        print("\n".join(result.overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
