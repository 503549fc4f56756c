"""What a tenant is shown: a record's log, and why it is missing when Ray cannot give it."""

from __future__ import annotations

import pytest
from fake_jobs_api import FakeClient, manager, running_record

from service.ray_failures import RayUnavailable


def test_logs_say_why_they_are_missing(tmp_path):
    client = FakeClient()
    mgr = manager(tmp_path, client)
    record = running_record(mgr)
    assert mgr.views.logs(record, 10) == "line\n"
    client.errors["get_job_logs"] = [RuntimeError("Request failed with status code 500: boom.")]
    with pytest.raises(RayUnavailable, match="did not return the logs of etrain-j-abc-0") as info:
        mgr.views.logs(record, 10)
    assert not info.value.missing
    client.errors["get_job_logs"] = [RuntimeError("Request failed with status code 404: Job x does not exist.")]
    with pytest.raises(RayUnavailable, match="no longer has the logs") as info:
        mgr.views.logs(record, 10)
    assert info.value.missing
