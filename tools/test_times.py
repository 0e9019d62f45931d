"""Where the test suite's time goes: ``python -m tools.test_times JUNIT_XML [--top N] [--budgets MD] [--all OUT]``.

Reads the JUnit XML that ``pytest --junitxml`` writes (``.ci/run`` keeps it in ``.ci/logs/``) and prints
the ``--top`` slowest tests, then every test file whose summed test time exceeds its budget in the table
of ``--budgets`` (docs/testing.md: rows ``| tests/.../test_x.py | seconds |``). A file absent from
the table has the table's ``(any other file)`` budget. ``--all`` writes every test's time, slowest
first. Times are each test's own (setup, call and teardown); with two workers the files' sum exceeds the
wall time. Exit status 0 always: the budgets are a signal in the log, not a gate.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import xml.etree.ElementTree as ET
from typing import Dict, List, Tuple

_ROW = re.compile(r"^\|\s*`?([^|`]+?)`?\s*\|\s*([0-9]+)\s*\|")
OTHER = "(any other file)"


def read_times(path: str) -> List[Tuple[float, str]]:
    """``(seconds, test id)`` of every test case in the JUnit XML at ``path``, slowest first."""
    out = []
    for case in ET.parse(path).iter("testcase"):
        parts, name = case.get("classname", "").split("."), case.get("name", "")
        mod = max((i for i, p in enumerate(parts) if p.startswith("test_")), default=len(parts) - 1)
        test = "/".join(parts[: mod + 1]) + ".py::" + "::".join([*parts[mod + 1 :], name])
        out.append((float(case.get("time") or 0.0), test))
    return sorted(out, reverse=True)


def read_budgets(path: str) -> Dict[str, float]:
    """The per-file budgets (seconds) of the markdown table in ``path``."""
    budgets = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = _ROW.match(line.strip())
            if m:
                budgets[m.group(1).strip()] = float(m.group(2))
    return budgets


def per_file(times: List[Tuple[float, str]]) -> Dict[str, float]:
    """Summed seconds per test file."""
    files: Dict[str, float] = collections.Counter()
    for t, test in times:
        files[test.split("::")[0]] += t
    return dict(files)


def over_budget(files: Dict[str, float], budgets: Dict[str, float]) -> List[Tuple[str, float, float]]:
    """``(file, seconds, budget)`` of the files over their budget, largest excess first."""
    default = budgets.get(OTHER, float("inf"))
    rows = [(f, t, budgets.get(f, default)) for f, t in files.items()]
    return sorted([r for r in rows if r[1] > r[2]], key=lambda r: r[2] - r[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit", help="the XML written by pytest --junitxml")
    ap.add_argument("--top", type=int, default=10, help="how many of the slowest tests to print")
    ap.add_argument("--budgets", help="markdown file with the per-file budget table (docs/testing.md)")
    ap.add_argument("--all", dest="all_out", help="write every test's time to this file")
    args = ap.parse_args(argv)
    try:
        times = read_times(args.junit)
    except (OSError, ET.ParseError) as e:
        print(f"test_times: cannot read {args.junit}: {e}", file=sys.stderr)
        return 0
    print(f"slowest {args.top} tests (of {len(times)}, {sum(t for t, _ in times):.0f} s summed):")
    for t, test in times[: args.top]:
        print(f"  {t:7.1f} s  {test}")
    if args.budgets:
        rows = over_budget(per_file(times), read_budgets(args.budgets))
        print(f"test files over their budget in {args.budgets}: {len(rows) or 'none'}")
        for f, t, b in rows:
            print(f"  {t:7.1f} s > {b:.0f} s  {f}")
    if args.all_out:
        with open(args.all_out, "w", encoding="utf-8") as f:
            f.writelines(f"{t:8.2f}  {test}\n" for t, test in times)
    return 0


if __name__ == "__main__":
    sys.exit(main())
