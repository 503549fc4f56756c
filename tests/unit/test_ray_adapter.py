"""Ray's internals stay in cluster/ray_adapter/: the rest of trainers/, service/ and cluster/ neither
imports them, reaches for them by attribute, nor names an environment knob of Ray. Read from the
source (imports, dotted names, attributes, string constants), so a use anywhere in a module is seen.

What each adapter file relies on is pinned against the installed Ray in tests/unit/test_ray_adapter_<file>.py.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ADAPTER = REPO / "cluster" / "ray_adapter"
# Ray's modules that are not API (besides any module or name of Ray's that starts with "_").
INTERNAL = ("ray._private", "ray._raylet", "ray.experimental.internal_kv", "ray.train.v2._internal", "ray.serve._private")
# Attributes of Ray's objects that are not API and that the adapter reaches for.
INTERNAL_ATTRIBUTES = {"temporary_state", "_global_node", "preemption_context"}
RAY_ACTOR_METHOD = re.compile(r"__ray_\w+__")  # every actor's built-in methods (``__ray_ready__``, ...)
RAY_KNOB = re.compile(r"(RAY|TUNE)_\w*")  # an environment variable Ray or Ray Tune reads


def is_internal(name: str) -> bool:
    """A dotted name inside Ray that is not its API: a listed module, or any ``_``-named part."""
    parts = name.split(".")
    private = any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts[1:])
    return parts[0] == "ray" and (name.startswith(INTERNAL) or private)


def dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for an attribute chain on a plain name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def ray_internals_in(path: Path) -> dict[int, str]:
    """Each line of ``path`` that uses one of Ray's internals, with what it uses."""
    found: dict[int, str] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute):
            names = [n for n in [dotted(node)] if n]
            if node.attr in INTERNAL_ATTRIBUTES or RAY_ACTOR_METHOD.fullmatch(node.attr):
                found.setdefault(node.lineno, f"Ray's internal attribute .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and RAY_KNOB.fullmatch(node.value):
            found.setdefault(node.lineno, f"Ray's environment knob {node.value}")
            continue
        else:
            continue
        for name in names:
            if is_internal(name):
                found.setdefault(node.lineno, name)
    return found


def test_no_module_but_the_adapter_uses_ray_internals():
    offenders = []
    for path in sorted([*REPO.glob("trainers/**/*.py"), *REPO.glob("service/**/*.py"), *REPO.glob("cluster/**/*.py")]):
        if ADAPTER in path.parents:
            continue
        offenders += [f"{path.relative_to(REPO)}:{line}: {what}" for line, what in sorted(ray_internals_in(path).items())]
    assert not offenders, ("Ray internals outside cluster/ray_adapter/ (move them into the adapter file of their "
                           f"kind, pinned by its test): {offenders}")


def test_the_guard_sees_what_it_must(tmp_path):
    """The reader itself, on a sample: each kind of use is seen, in a function's body too; Ray's API is not."""
    path = tmp_path / "sample.py"
    path.write_text(
        "import os\n"
        "import ray._private.state\n"
        "from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError\n"
        "from ray.experimental import internal_kv\n"
        "from ray.train.torch.config import _setup_torch_process_group\n"
        "def f(trial, actor, monkeypatch):\n"
        "    ray._private.worker.global_worker\n"
        "    ray.train._internal.utils\n"
        "    trial.temporary_state.ray_actor\n"
        "    actor.__ray_ready__.remote()\n"
        "    os.environ.setdefault('RAY_TRAIN_HEALTH_CHECK_INTERVAL_S', '0.5')\n"
        "    os.environ['RAY_ADDRESS']\n"
        "    monkeypatch.setenv('TUNE_GLOBAL_CHECKPOINT_S', '1')\n"
        "    return {'RAY_worker_niceness': '0'}\n"
        "def fine():\n"
        "    import ray.train\n"
        "    from ray.util.placement_group import placement_group_table\n"
        "    ray.train.get_context(), ray.__version__, os.environ.get('ETRAIN_TOKENS')\n"
        "    return 'set RAY_ADDRESS to the head node'\n")
    found = ray_internals_in(path)
    assert sorted(found) == [2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 13, 14], found
    assert found[9] == "Ray's internal attribute .temporary_state" and found[12] == "Ray's environment knob RAY_ADDRESS"
