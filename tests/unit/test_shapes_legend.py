"""Every shape suffix of a tensor name in ``folding/moe`` and ``folding/model`` is in the one legend,
``docs/shapes.md`` (its table; the rule that finds a suffix is written there too)."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECKED = ("folding/moe", "folding/model")
# optional underscores, a lowercase start, then ``_SUFFIX`` at the end with SUFFIX starting uppercase
SUFFIXED = re.compile(r"_*[a-z][A-Za-z0-9_]*?_([A-Z][A-Za-z0-9]*)")
TOKEN = re.compile(r"[A-Z][a-z]*|[0-9]+")


def legend() -> set:
    """The tokens of the legend table of ``docs/shapes.md`` (its first column)."""
    text = open(os.path.join(ROOT, "docs", "shapes.md"), encoding="utf-8").read()
    return set(re.findall(r"^\| `([A-Za-z0-9]+)` \|", text, flags=re.M))


def identifiers(tree):
    """``(line, name)`` of every variable, argument, attribute and function name (no class names)."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            yield n.lineno, n.id
        elif isinstance(n, ast.arg):
            yield n.lineno, n.arg
        elif isinstance(n, ast.Attribute):
            yield n.lineno, n.attr
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield n.lineno, n.name
        elif isinstance(n, ast.keyword) and n.arg:
            yield n.value.lineno, n.arg


def unknown_suffixes(source: str, known: set) -> list:
    """``(line, name, token)`` of each suffix token of ``source``'s identifiers missing from ``known``."""
    out = []
    for line, name in identifiers(ast.parse(source)):
        m = SUFFIXED.fullmatch(name)
        if m:
            suffix = m.group(1)
            tokens = TOKEN.findall(suffix)
            if "".join(tokens) != suffix:  # a lowercase letter after a digit (``N2x``) is no token
                out.append((line, name, suffix))
            out += [(line, name, t) for t in tokens if t not in known]
    return out


def test_legend_table_reads():
    assert {"T", "E", "L", "F", "Fl", "K", "N", "H", "1", "2"} <= legend()


def test_every_suffix_is_in_the_legend():
    known, bad, seen = legend(), [], 0
    for d in CHECKED:
        for root, _, files in os.walk(os.path.join(ROOT, d)):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    src = open(path, encoding="utf-8").read()
                    seen += sum(bool(SUFFIXED.fullmatch(n)) for _, n in identifiers(ast.parse(src)))
                    rel = os.path.relpath(path, ROOT)
                    bad += [
                        f"{rel}:{ln}: {name} ({tok!r} is not in docs/shapes.md)"
                        for ln, name, tok in unknown_suffixes(src, known)
                    ]
    assert seen > 200  # the scan finds the suffixed names it should
    assert not bad, "\n".join(bad)


def test_the_rule_itself():
    known = legend()
    ok = "x_SBH = 1\nh_NFl2 = p_N1 = counts_ETP_E = 0\nclass _SwiGLUProb: pass\nMAX_E = 3\ndef _map_TgE(w_LOI): pass\n"
    assert unknown_suffixes(ok, known) == []
    assert unknown_suffixes("y_NK = 0\n", known) == []  # K (top-k) is a legend letter: only unknown ones fail
    assert unknown_suffixes("x_NQ = f(gate_NFx=1)\n", known) == [(1, "x_NQ", "Q"), (1, "gate_NFx", "Fx")]
    assert unknown_suffixes("def f(self):\n    self.w_VHz = 0\n", known) == [(2, "w_VHz", "Hz")]
    assert unknown_suffixes("h_N2x = 0\n", known) == [(1, "h_N2x", "N2x")]
