"""Print the rank groups of a folded layout (pure math: no processes are started).

Usage::

    python -m tools.layout --world 8 --tp 2 --cp 2 --ep 8 --etp 1          # tables
    python -m tools.layout --world 8 --tp 2 --cp 2 --ep 8 --etp 1 --json   # JSON only on stdout

Omitted sizes default to 1 (``--etp`` to ``--tp``). An impossible layout exits with status 2 and a
one-line message on stderr naming the violated constraint and the flag to change. The tables name
the expert groups ``etp``, ``ep``, ``edp`` as the user guide does; the JSON keeps the rank-math keys
(``expert.tp`` is ETP, ``expert.dp`` is EDP).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from folding.parallel import DEFAULT_ORDER, LayoutError, ParallelLayout

EXPERT_LABELS = {"tp": "etp", "dp": "edp", "tp-ep": "etp-ep", "tp-ep-pp": "etp-ep-pp"}
"""Table labels of the expert groups (the rank math's keys -> the user guide's names)."""


def flag_hint(message: str) -> str:
    """A layout error with the training config's keys replaced by this tool's flags."""
    message = re.sub(r"parallel\.(\w+\*)", r"\1", message)  # a product: tp*cp*pp
    message = re.sub(r"parallel\.(\w+)=null", r"no --\1", message)
    message = re.sub(r"parallel\.(\w+)=([^\s;,)]+)", r"--\1 \2", message)
    message = re.sub(r"parallel\.(\w+)", r"--\1", message)
    message = re.sub(r"\be\.g\. (\w+)=(\w+)", r"e.g. --\1 \2", message)
    message = message.replace("num_experts=", "--num-experts ").replace("the number of ranks", "--world")
    return message


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, required=True, help="number of ranks")
    for axis in ("tp", "cp", "pp", "ep"):
        p.add_argument(f"--{axis}", type=int, default=1, help=f"{axis.upper()} size (default 1)")
    p.add_argument("--etp", type=int, default=None, help="expert TP size (default: --tp)")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages (needs --pp > 1)")
    p.add_argument("--order", default=DEFAULT_ORDER, help=f"axis order, fastest first (default {DEFAULT_ORDER})")
    p.add_argument("--num-experts", type=int, default=None, help="check num_experts %% ep == 0")
    p.add_argument("--json", action="store_true", help="print only JSON on stdout")
    return p.parse_args(argv)


def _table(title, groups, labels=None):
    lines = [f"{title}"]
    for token, gs in groups.items():
        token = (labels or {}).get(token, token)
        body = " ".join("[" + ",".join(map(str, g)) + "]" for g in gs)
        lines.append(f"  {token:<10} {len(gs):>4} x {len(gs[0]) if gs else 0:<4} {body}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        layout = ParallelLayout(
            world_size=args.world,
            tp=args.tp,
            cp=args.cp,
            pp=args.pp,
            vpp=args.vpp,
            ep=args.ep,
            etp=args.etp,
            order=args.order,
            num_experts=args.num_experts,
        )
    except LayoutError as e:
        print(f"error: {flag_hint(str(e))}", file=sys.stderr)
        return 2
    groups = layout.groups()
    if args.json:
        print(json.dumps(groups))
        return 0
    print(f"{layout.world_size} rank{'' if layout.world_size == 1 else 's'}, order {layout.order}: {layout.describe()}")
    print(_table("attention (TP x CP x DP x PP)", groups["attention"]))
    print(_table("expert (ETP x EP x EDP x PP)", groups["expert"], EXPERT_LABELS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
