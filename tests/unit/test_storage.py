"""Storage URIs and a local root (cluster/storage.py)."""

from __future__ import annotations

import pytest

from cluster.storage import check_uri, open_root
from trainers.config.loading import validate
from trainers.job_folder import job_home


@pytest.mark.parametrize("uri,ok", [("/tmp/x", True), ("file:///tmp/x", True), ("s3://bucket/p", True),
                                    ("s3://b", False), ("gs://b/x", False), ("", False)])
def test_check_uri(uri, ok):
    assert (check_uri(uri) is None) == ok


def test_local_root_roundtrip_and_run_paths(tmp_path):
    root = open_root(str(tmp_path / "r"))
    root.write_json({"a": 1}, "job", "summary.json")
    assert root.read_json("job", "summary.json") == {"a": 1}
    assert root.list_dirs() == ["job"]
    spec = validate({"name": "j", "checkpoint": {"path": "ckpts/nested/model_{step}.pt", "storage_root": str(tmp_path)}})
    home = job_home(spec)
    assert home.ray_paths() == (f"{tmp_path}/j/ckpts", "nested") and home.uri == f"{tmp_path}/j"
