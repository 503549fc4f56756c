"""House rules read from the source: no module over 500 lines, nothing printed outside
command-line front ends (library code logs), and every unit test module named after the module
it tests. Each rule names what breaks it and how to mend it."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAYERS = ("trainers", "cluster", "service")
MAX_LINES = 500
# Command-line front ends: the only modules that may print (what a person at a terminal reads)
FRONT_ENDS = {"trainers/cli.py", "trainers/sweep/cli.py", "cluster/cli.py", "service/cli.py",
              "cluster/rehearsal/__main__.py",
              "trainers/console.py"}  # `etrain run`'s terminal display (the live progress line)
# Unit test modules about a rule, or about a file that is not a Python module of ours
NOT_A_MODULE = {"code_rules", "layers", "driver_imports", "exit_status",
                "system_packages",  # tests/system_packages.sh
                "spot_priority"}  # ray_cluster.yaml's node types under Ray's own autoscaler


def library_modules() -> list[Path]:
    return sorted(p for layer in LAYERS for p in (REPO / layer).rglob("*.py"))


def printing_calls(path: Path) -> list[int]:
    """Lines that print: a print() call, print passed as a value (``say=print``), sys.stdout/stderr.write;
    a module's own ``main`` (its command line, ``python -m``) may."""
    found = []
    tree = ast.parse(path.read_text())
    mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    in_main = {id(x) for m in mains for x in ast.walk(m)}
    for node in ast.walk(tree):
        if id(node) in in_main:
            continue
        if isinstance(node, ast.Name) and node.id == "print":
            found.append(node.lineno)
        elif (isinstance(node, ast.Attribute) and node.attr == "write" and isinstance(node.value, ast.Attribute)
              and node.value.attr in ("stdout", "stderr")):
            found.append(node.lineno)
    return found


def module_names() -> set[str]:
    """What a unit test module may be named after: each module's name, and its path below its layer
    joined with underscores (cluster/ray_adapter/kv.py: kv, ray_adapter_kv)."""
    names = set()
    for path in [*library_modules(), *(REPO / "bench").glob("*.py"), *(REPO / "tests").rglob("*.py")]:
        parts = path.relative_to(REPO).with_suffix("").parts
        names.add(parts[-1] if parts[-1] != "__init__" else parts[-2])
        inner = [p for p in parts[1:] if p != "__init__"]
        for i in range(len(inner)):
            names.add("_".join(inner[i:]))
    return names


def test_no_module_is_over_500_lines():
    long = {p.relative_to(REPO).as_posix(): n for p in library_modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines (split them by concern): {long}"


def test_only_command_line_front_ends_print():
    printing = {rel: lines for p in library_modules()
                if (rel := p.relative_to(REPO).as_posix()) not in FRONT_ENDS and (lines := printing_calls(p))}
    assert printing == {}, ("library modules print (use logging.getLogger(__name__); cluster.log_lines formats "
                            f"our lines): {printing}")


def named_after(stem: str, known: set[str]) -> bool:
    """``test_<module>`` or ``test_<module>_<aspect>`` (test_storage_writes: cluster/storage.py's writes)."""
    name = stem.removeprefix("test_")
    return name in known or any(name.startswith(k + "_") for k in known)


def test_every_unit_test_module_is_named_after_a_module():
    known = module_names() | NOT_A_MODULE
    stray = sorted(p.name for p in (REPO / "tests" / "unit").glob("test_*.py") if not named_after(p.stem, known))
    assert stray == [], f"unit test modules not named after the module they test (test_<module>.py): {stray}"


def test_the_rules_see_what_they_must(tmp_path):
    assert named_after("test_storage_writes", {"storage"}) and not named_after("test_page_parts", {"web", "page_x"})
    sample = tmp_path / "sample.py"
    sample.write_text("import sys\n\ndef f(say=print):\n    print('x')\n    sys.stderr.write('y')\n\n"
                      "def main():\n    print('a command line may')\n")
    assert printing_calls(sample) == [3, 4, 5]
