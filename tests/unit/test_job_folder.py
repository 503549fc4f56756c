"""A job's folder, its key and the names of its files (trainers/job_folder.py): each name spelled
there only."""

from __future__ import annotations

import pytest

from trainers.config.loading import validate
from trainers.job_folder import job_home


@pytest.mark.parametrize("path,job_folder,run_path", [
    ("/checkpoints/model_{step}.pt", "/checkpoints", "/checkpoints"),
    ("/mnt/shared/runs/a/model_{step}.pt", "/mnt/shared/runs/a", "/mnt/shared/runs/a"),
    ("checkpoints/model_{step}.pt", "{root}/j", "{root}/j/checkpoints"),
    ("model_{step}.pt", "{root}/j", "{root}/j/checkpoints"),
])
def test_an_absolute_checkpoint_path_is_the_jobs_folder(tmp_path, path, job_folder, run_path):
    home = job_home(validate({"name": "j", "checkpoint": {"path": path, "storage_root": str(tmp_path)}}))
    assert home.uri == job_folder.format(root=tmp_path) and home.run_path == run_path.format(root=tmp_path)


def test_two_jobs_of_one_name_in_two_roots_have_two_keys(tmp_path):
    a, b = (job_home(validate({"name": "quickstart", "checkpoint": {"storage_root": str(tmp_path / r)}}))
            for r in ("a", "b"))
    assert a.key != b.key and a.key.startswith("etrain/quickstart-")


def job_file_names() -> set[str]:
    from trainers import job_folder

    return {v for k, v in vars(job_folder).items() if k.endswith(("_FILE", "_DIR")) and isinstance(v, str)}


def test_a_jobs_file_names_are_spelled_in_job_folder_only():
    """Every other module names them through trainers.job_folder (the service through trainers.api).
    Folder names ("metrics", "profiles") are also common words of keys and commands: files only."""
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    names, spelled = {n for n in job_file_names() if "." in n}, []
    for path in sorted(p for layer in ("trainers", "service", "cluster") for p in (repo / layer).rglob("*.py")):
        if path.name == "job_folder.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                spelled.append(f"{path.relative_to(repo)}:{node.lineno}: {node.value!r}")
    assert {"summary.json", "interruptions.json", "job.json", "results.json"} <= names
    assert spelled == [], f"job file names spelled outside trainers/job_folder.py: {spelled}"


def test_interruptions_read_as_an_empty_list_until_the_first_is_written(tmp_path):
    from cluster.storage import open_root
    from trainers.job_folder import INTERRUPTIONS_FILE, read_interruptions

    root = open_root(str(tmp_path))
    assert read_interruptions(root, "job") == []
    root.write_json([{"cause": "preemption"}], "job", INTERRUPTIONS_FILE)
    assert read_interruptions(root, "job") == [{"cause": "preemption"}]
