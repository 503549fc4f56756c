"""cluster.ray_session: which Ray a command joins, the CPUs a local one gets, and the node watch.

Which Ray `etrain run` joins: RAY_ADDRESS, a live `ray start` on record, or a new local one.
A record left by a Ray that was killed (no `ray stop`) is removed: Ray's own "auto" lookups in
the local Ray started instead would otherwise query the dead address (Ray Train's
placement-group cleaner waited 12 s at the end of every run, and printed a traceback).

A local Ray is sized by the CPUs this process may use, not by the machine's.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.ray_adapter.local import address_record
from cluster.ray_session import is_local_host, running_cluster_address, split_address

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def ray_temp(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    (tmp_path / "ray").mkdir()
    return tmp_path / "ray"


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_record_is_rays_own_file_in_rays_temp_dir(ray_temp):
    assert address_record() == ray_temp / "ray_current_cluster"


def test_a_record_of_a_dead_ray_is_removed(ray_temp):
    record = ray_temp / "ray_current_cluster"
    record.write_text(f"127.0.0.1:{dead_port()}")
    assert running_cluster_address() is None
    assert not record.exists()


def test_a_live_cluster_on_record_is_joined_and_its_record_kept(ray_temp):
    record = ray_temp / "ray_current_cluster"
    with socket.socket() as gcs:
        gcs.bind(("127.0.0.1", 0))
        gcs.listen()
        address = f"127.0.0.1:{gcs.getsockname()[1]}"
        record.write_text(address)
        assert running_cluster_address() == address
    assert record.read_text() == address


def test_ray_address_wins_and_no_record_means_a_new_local_ray(ray_temp, monkeypatch):
    assert running_cluster_address() is None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert running_cluster_address() == "10.0.0.5:6379"


def test_a_record_naming_another_machine_is_kept(ray_temp):
    """A worker node's record names the head: a head that does not answer now (restarting, a network
    blip) is no reason to forget it."""
    record = ray_temp / "ray_current_cluster"
    record.write_text("192.0.2.10:6379")  # TEST-NET: nothing answers
    assert running_cluster_address() is None
    assert record.read_text() == "192.0.2.10:6379"


def test_an_empty_record_being_written_is_kept(ray_temp):
    record = ray_temp / "ray_current_cluster"
    record.write_text("")
    assert running_cluster_address() is None
    assert record.exists()


@pytest.mark.parametrize("address, parsed", [
    ("127.0.0.1:6379", ("127.0.0.1", 6379)), ("[::1]:6379", ("::1", 6379)), ("head.internal:6380", ("head.internal", 6380)),
    ("", (None, 0)), ("127.0.0.1", (None, 0)), ("127.0.0.1:", (None, 0)), (":6379", (None, 0)),
])
def test_addresses_are_split_for_v4_v6_and_names(address, parsed):
    assert split_address(address) == parsed


@pytest.mark.parametrize("host, local", [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                         ("192.0.2.10", False), ("head.example", False)])
def test_only_this_machines_addresses_are_local(host, local):
    assert is_local_host(host) is local


def test_a_process_held_to_one_cpu_sizes_its_local_ray_by_that_cpu():
    """Under taskset (or a container's cpuset) os.cpu_count() still says the machine's count."""
    assert len(os.sched_getaffinity(0)) >= 2, "this test needs a machine with two CPUs to hold a process to one"
    cpu = min(os.sched_getaffinity(0))
    out = subprocess.run(["taskset", "--cpu-list", str(cpu), sys.executable, "-c",
                          "import os; from cluster.ray_session import usable_cpus; print(usable_cpus(), os.cpu_count())"],
                         capture_output=True, text=True, cwd=REPO, timeout=120, check=True)
    usable, machine = map(int, out.stdout.split())
    assert (usable, machine) == (1, os.cpu_count())


def test_the_node_watch_refreshes_the_planner_when_nodes_come_or_go(monkeypatch):
    import time

    from cluster import ray_session
    from cluster.ray_adapter import cluster_view

    nodes = [{"NodeID": "a", "Alive": True}]
    refreshed = []
    monkeypatch.setattr(ray_session.ray, "nodes", lambda: list(nodes))
    monkeypatch.setattr(cluster_view, "refresh_cluster_view", lambda: refreshed.append(len(nodes)))
    with ray_session.NodeWatch(0.5):
        time.sleep(1.2)
        assert refreshed == [], "no change, no refresh"
        nodes.append({"NodeID": "b", "Alive": True})  # a spot node joins
        deadline = time.time() + 10
        while not refreshed and time.time() < deadline:
            time.sleep(0.1)
        assert refreshed == [2]
    with ray_session.NodeWatch(0.5, enabled=False):
        nodes.pop()
        time.sleep(1.2)
    assert refreshed == [2], "a fixed-size job is never resized: nothing to watch"
