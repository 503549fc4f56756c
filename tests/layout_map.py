"""The README's layout map, made from the tree: each package's modules with the first sentence of
their docstrings. `python tests/layout_map.py --write` rewrites the map between its markers in
README.md; tests/unit/test_layout_map.py fails when the README's map is not the tree's."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("trainers", "cluster", "service", "bench")
BEGIN, END = "<!-- layout map: made by `python tests/layout_map.py --write` -->", "<!-- end of layout map -->"
WIDTH = 100  # characters of a module's summary


def summary(path: Path) -> str:
    """The first sentence of a module's docstring, on one line, cut at WIDTH characters."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = re.split(r"(?<=\.)\s", " ".join(doc.split()), maxsplit=1)[0].rstrip(".:;")
    return first if len(first) <= WIDTH else first[:WIDTH - 3].rstrip() + "..."


def modules(package: str) -> list[Path]:
    return sorted(p for p in (REPO / package).rglob("*.py") if p.name != "__init__.py" or p.stat().st_size > 0)


def layout_map() -> str:
    lines = [BEGIN, "", "| module | what it holds |", "|---|---|"]
    for package in PACKAGES:
        for path in modules(package):
            lines.append(f"| `{path.relative_to(REPO).as_posix()}` | {summary(path).replace('|', '/')} |")
    return "\n".join([*lines, "", END])


def readme_with_map(readme: str) -> str:
    """``readme`` with its map replaced by the tree's (the markers must be there)."""
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    return readme[:start] + layout_map() + readme[end:]


if __name__ == "__main__":
    path = REPO / "README.md"
    fresh = readme_with_map(path.read_text())
    if "--write" in sys.argv[1:]:
        path.write_text(fresh)
    else:
        print(layout_map())
