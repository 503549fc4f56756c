"""A job's folder and key (trainers/home.py)."""

from __future__ import annotations

import pytest

from trainers.config.loading import validate
from trainers.home import job_home


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
