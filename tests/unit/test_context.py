"""The parts' shared context: Ray's Jobs client talks to the jobs cluster it is given."""

from __future__ import annotations

import os

from fake_jobs_api import FakeDashboard

from service.jobs import JobManager
from service.settings import ServiceSettings


def test_the_jobs_client_talks_to_the_dashboard_it_is_given_whatever_ray_address_says(tmp_path, monkeypatch):
    """The service joins its own Ray by RAY_ADDRESS; Ray's client would take that over the jobs
    cluster's URL and send every job to the service's own cluster."""
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    dash = FakeDashboard()
    try:
        monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # the service's own cluster
        monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://127.0.0.1:1")
        mgr = JobManager(ServiceSettings(storage_root=str(tmp_path / "root"), state_dir=str(tmp_path / "state"),
                                         ray_dashboard_url=dash.url))
        mgr.client.submit_job(entrypoint="true", submission_id="etrain-x-0")
        assert [p["submission_id"] for p in dash.posts] == ["etrain-x-0"]
        assert os.environ["RAY_ADDRESS"] == "127.0.0.1:1", "the process's own setting is left as it was"
    finally:
        dash.close()
