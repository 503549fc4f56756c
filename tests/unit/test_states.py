"""The job states are named once (service/states.py): every other service module says JobState.X, so a
renamed or added state cannot leave a stale spelling behind. Read from the source's string constants,
docstrings aside (they explain, they decide nothing); service/templates and service/static keep theirs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from service.states import JobState, RayStatus

REPO = Path(__file__).resolve().parents[2]
NAMES = re.compile(r"\b(" + "|".join(sorted({s.value for s in (*JobState, *RayStatus)})) + r")\b")


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants of a module, its classes and its functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def spelled_states(path: Path) -> list[str]:
    """'file:line: text' for each string constant in ``path`` that spells a state name."""
    tree = ast.parse(path.read_text())
    skip = docstrings(tree)
    return [f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
            and NAMES.search(node.value)]


def test_no_service_module_spells_a_state_but_states_py():
    found = [hit for path in sorted((REPO / "service").glob("*.py")) if path.name != "states.py"
             for hit in spelled_states(path)]
    assert found == [], "use service.states (JobState, RayStatus) instead of these literals:\n" + "\n".join(found)


def test_the_scan_sees_a_literal_and_names_its_line(tmp_path):
    (tmp_path / "service").mkdir()
    path = tmp_path / "service" / "sample.py"
    path.write_text('"""A RUNNING docstring is prose."""\n\nx = 1\nif state == "RUNNING":\n    msg = f"is {s}: only STOPPED"\n')
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        assert spelled_states(path) == ["service/sample.py:4: 'RUNNING'", "service/sample.py:5: ': only STOPPED'"]
    finally:
        REPO = saved


def test_rays_statuses_are_the_ones_we_know():
    """The reconciler compares Ray's JobStatus names with RayStatus: a status Ray adds must be decided here."""
    from ray.job_submission import JobStatus

    assert {s.value for s in JobStatus} <= {s.value for s in RayStatus}
