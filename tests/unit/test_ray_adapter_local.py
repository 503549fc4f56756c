"""The Ray internals cluster/ray_adapter/local.py relies on are still where it reaches for them.

These run against the installed (pinned) Ray without starting it: an upgrade that moves or
changes one fails here, by name, before a job meets it.
"""

from __future__ import annotations

import inspect
import os

import pytest

from cluster.ray_adapter import local


def test_a_head_started_here_still_reads_its_gcs_port_from_the_environment():
    from ray._private import node, ray_constants

    assert ray_constants.GCS_PORT_ENVIRONMENT_VARIABLE == local.GCS_PORT_ENV
    assert "os.getenv(ray_constants.GCS_PORT_ENVIRONMENT_VARIABLE)" in inspect.getsource(node.Node.__init__)


def test_a_local_ray_keeps_loopback_whatever_was_imported_first(monkeypatch):
    """Ray read RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at its import; keep_on_loopback sets what it read."""
    from ray._private import ray_constants, services

    assert ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR == local.LOOPBACK_ENV
    monkeypatch.delenv(local.LOOPBACK_ENV, raising=False)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)  # as a script that imported ray first has it
    assert local.keep_on_loopback() == {local.LOOPBACK_ENV: "0"}  # for the processes it starts
    assert ray_constants.ENABLE_RAY_CLUSTER is False
    assert services.resolve_ip_for_localhost("127.0.0.1") == "127.0.0.1"
    assert local.LOOPBACK_ENV not in os.environ, "this process's environment is left as it was"


@pytest.mark.parametrize("value, kept_on", [("1", True), ("TRUE", True), ("false", False), ("0", False)])
def test_a_users_own_setting_is_read_as_ray_reads_it(monkeypatch, value, kept_on):
    from ray._private import ray_constants

    monkeypatch.setenv(local.LOOPBACK_ENV, value)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    pinned = local.keep_on_loopback()
    assert ray_constants.ENABLE_RAY_CLUSTER is kept_on and pinned == ({} if kept_on else {local.LOOPBACK_ENV: value})


def test_a_local_start_off_its_address_says_why():
    said = local.local_start_problem("192.0.2.2:4321", "127.0.0.1:4321")
    assert "swapped the loopback address" in said and "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" in said, said
    assert "RAY_GCS_SERVER_PORT ignored" in local.local_start_problem("127.0.0.1:9", "127.0.0.1:4321")
    assert "RAY_GCS_SERVER_PORT ignored" in local.local_start_problem("127.0.0.2:4321", "127.0.0.1:4321")
    assert local.local_start_problem("127.0.0.1:4321", "127.0.0.1:4321") is None
    assert [local.is_loopback(h) for h in ("127.0.0.1", "::1", "192.0.2.2", "localhost")] == [True, True, False, False]


def test_rays_temp_folder_follows_ray_tmpdir_and_holds_the_prometheus_discovery_file(monkeypatch, tmp_path):
    """`ray start` on a node with RAY_TMPDIR set writes its address record and the Prometheus
    discovery file under it; `etrain prometheus-config` must look there, not in /tmp."""
    import ray._private.ray_constants

    from cluster.cli import prometheus_discovery_file
    from cluster.ray_adapter.local import PROMETHEUS_DISCOVERY_FILE, address_record, ray_temp_dir

    assert PROMETHEUS_DISCOVERY_FILE == ray._private.ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    assert ray_temp_dir() == tmp_path / "ray"
    assert address_record().parent == tmp_path / "ray"
    assert prometheus_discovery_file() is None  # none yet: the scrape config then lists the live nodes only
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / PROMETHEUS_DISCOVERY_FILE).write_text("[]")
    assert prometheus_discovery_file() == str(tmp_path / "ray" / PROMETHEUS_DISCOVERY_FILE)


def test_the_session_folder_is_still_where_the_adapter_reads_it():
    from ray._private import worker
    from ray._private.node import Node

    assert hasattr(worker, "_global_node"), "ray._private.worker._global_node is gone: session_folder needs another way"
    assert callable(Node.get_session_dir_path)
    # a local start makes the driver's node the head: shutdown_local_ray tells started from joined by it
    assert "self.head = head" in inspect.getsource(Node.__init__), "Node.head is gone: session_folder needs another way"
    assert local.session_folder() is None  # not connected: nothing to clean up after


def test_the_address_variable_is_rays_and_the_loopback_default_keeps_a_users_value(monkeypatch):
    from ray._private import ray_constants

    assert ray_constants.RAY_ADDRESS_ENVIRONMENT_VARIABLE == local.ADDRESS_ENV
    monkeypatch.delenv(local.LOOPBACK_ENV, raising=False)
    local.default_to_loopback()
    assert os.environ[local.LOOPBACK_ENV] == "0"
    monkeypatch.setenv(local.LOOPBACK_ENV, "1")
    local.default_to_loopback()
    assert os.environ[local.LOOPBACK_ENV] == "1", "a user's own setting stays"
