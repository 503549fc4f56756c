"""The README's layout map is the tree's (tests/layout_map.py): a module added, moved or whose
docstring changed shows in the map, or this fails with the command that mends it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import layout_map  # noqa: E402  (tests/ is not a package)


def test_the_readmes_layout_map_is_the_trees():
    readme = (layout_map.REPO / "README.md").read_text()
    assert readme == layout_map.readme_with_map(readme), (
        "README.md's layout map is stale: run `python tests/layout_map.py --write`")


def test_the_map_names_every_module_with_its_first_sentence(tmp_path, monkeypatch):
    (tmp_path / "trainers").mkdir()
    (tmp_path / "trainers" / "loop.py").write_text('"""The per-worker loop. More words here."""\n')
    for package in ("cluster", "service", "bench"):
        (tmp_path / package).mkdir()
    monkeypatch.setattr(layout_map, "REPO", tmp_path)
    made = layout_map.layout_map()
    assert "| `trainers/loop.py` | The per-worker loop |" in made
    stale = f"intro\n{layout_map.BEGIN}\nold\n{layout_map.END}\nafter\n"
    assert layout_map.readme_with_map(stale) == f"intro\n{made}\nafter\n"
