"""The Ray internals cluster/ray_adapter/dashboard.py relies on are still where it reaches for them.

These run against the installed (pinned) Ray without starting it: an upgrade that moves or
changes one fails here, by name, before a job meets it.
"""

from __future__ import annotations

import inspect
import os
import re

from cluster.ray_adapter import dashboard


def test_the_dashboard_getter_exists():
    from ray._private.worker import get_dashboard_url

    assert callable(get_dashboard_url)


def test_rays_clients_read_exactly_these_address_variables_and_ours_never_see_them(monkeypatch):
    """Ray's Jobs and state API clients resolve their address through one function that prefers these
    variables over the address given; a client built by dashboard_client talks to the address given."""
    from ray._private import ray_constants
    from ray.dashboard import utils
    from ray.dashboard.modules.job.sdk import JobSubmissionClient
    from ray.util.state.api import StateApiClient

    assert dashboard.ADDRESS_VARIABLES == (ray_constants.RAY_API_SERVER_ADDRESS_ENVIRONMENT_VARIABLE,
                                           ray_constants.RAY_ADDRESS_ENVIRONMENT_VARIABLE)
    source = inspect.getsource(utils.get_address_for_submission_client)
    assert set(re.findall(r"ray_constants\.(\w+_ENVIRONMENT_VARIABLE)", source)) == {
        "RAY_API_SERVER_ADDRESS_ENVIRONMENT_VARIABLE", "RAY_ADDRESS_ENVIRONMENT_VARIABLE"}
    for cls in (JobSubmissionClient, StateApiClient):
        assert "get_address_for_submission_client(address)" in inspect.getsource(cls.__init__), cls

    class Client:
        def __init__(self, url, headers=None):
            self.url, self.headers, self.seen = url, headers, {k: os.environ.get(k) for k in dashboard.ADDRESS_VARIABLES}

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://127.0.0.1:8265")
    client = dashboard.dashboard_client(Client, "http://10.0.0.9:8265", {"Authorization": "Bearer t"})
    assert client.seen == {"RAY_API_SERVER_ADDRESS": None, "RAY_ADDRESS": None}
    assert (client.url, client.headers) == ("http://10.0.0.9:8265", {"Authorization": "Bearer t"})
    assert os.environ["RAY_ADDRESS"] == "127.0.0.1:6379", "this process's environment is put back"
