"""The layers: service -> trainers -> cluster, and the service enters trainers through one door
(trainers.api; its command line may compose trainers.cli besides). Read from the source's import
statements, so a new import anywhere in a module (a function's own included) is seen."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports: ``import a.b``, ``from a.b import c`` (as a.b and a.b.c)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def trainers_modules(names: set[str]) -> set[str]:
    """The trainers modules among ``names``, by their first two parts (``from trainers import api``
    names trainers.api; ``import trainers`` alone names the package)."""
    return {".".join(n.split(".")[:2]) for n in names if n == "trainers" or n.startswith("trainers.")} - (
        {"trainers"} if any(n.startswith("trainers.") for n in names) else set())


def test_the_service_enters_trainers_only_through_its_api():
    wrong = {}
    for path in sorted((REPO / "service").glob("*.py")):
        allowed = {"trainers.api"} | ({"trainers.cli"} if path.name == "cli.py" else set())
        used = trainers_modules(imported_modules(path))
        if used - allowed:
            wrong[path.name] = sorted(used - allowed)
    assert wrong == {}, f"service modules import trainers past trainers.api: {wrong}"


def test_no_layer_imports_the_one_above_it():
    for lower, uppers in (("cluster", ("trainers", "service")), ("trainers", ("service",))):
        for path in sorted((REPO / lower).rglob("*.py")):
            above = {n for n in imported_modules(path) if n.split(".")[0] in uppers}
            assert not above, f"{path.relative_to(REPO)} imports {sorted(above)}: {lower} sits below {uppers}"


def test_the_guard_sees_what_it_must(tmp_path):
    """The reader itself: a function's own import, `from trainers import x` and a plain import count."""
    path = tmp_path / "sample.py"
    path.write_text("import trainers.sweep\nfrom trainers import api\n\ndef f():\n"
                    "    from trainers.history import read_history\n")
    assert trainers_modules(imported_modules(path)) == {"trainers.sweep", "trainers.api", "trainers.history"}
