"""Every relative link of the repository's Markdown files points at a file or folder that exists (a
moved report or module leaves no dead link behind)."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINK = re.compile(r"\]\(([^)\s]+)\)")
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".pytest_cache"}


def _markdown_files():
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        for f in files:
            if f.endswith(".md"):
                yield os.path.join(top, f)


def dead_links(path: str):
    """``(line number, target)`` of every relative link in the Markdown file ``path`` that resolves to
    nothing (anchors and web addresses are not checked)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            for target in LINK.findall(line):
                if "://" in target or target.startswith(("#", "mailto:")):
                    continue
                rel = target.split("#", 1)[0]
                if rel and not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(path), rel))):
                    out.append((n, target))
    return out


def test_relative_markdown_links_resolve():
    dead = {os.path.relpath(p, ROOT): d for p in _markdown_files() if (d := dead_links(p))}
    assert not dead, f"dead links (file: [(line, target)]): {dead}"


def test_a_dead_link_is_found(tmp_path):
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [web](https://example.org) [anchor](#a)\n[gone](../results/gone.md)\n")
    assert dead_links(str(page)) == [(2, "../results/gone.md")]
