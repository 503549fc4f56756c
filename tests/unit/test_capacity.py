"""GPU capacity from the autoscaler's node types: what `use_gpu: auto` and `etrain doctor` read."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.capacity import CONFIG_ENV, GpuCapacity, gpu_capacity, launchable_from_config

REPO = Path(__file__).resolve().parents[2]


def bootstrapped(aws: dict, gpus_per_node: int) -> dict:
    """What `ray up` leaves on the head: node types with resources filled in from the instance type."""
    for name, node_type in aws["available_node_types"].items():
        if name.startswith("gpu"):
            node_type["resources"] = {**node_type["resources"], "GPU": gpus_per_node, "CPU": 8}
    return aws


def test_the_shipped_cluster_can_launch_its_spot_and_on_demand_gpus():
    config = bootstrapped(yaml.safe_load((REPO / "ray_cluster.yaml").read_text()), 1)
    launchable, types = launchable_from_config(config)
    assert launchable == 8 + 2
    assert types == ("gpu_spot", "gpu_ondemand")


@pytest.mark.parametrize("config,expected", [
    ({}, 0),
    ({"available_node_types": {"cpu": {"resources": {"CPU": 4}, "max_workers": 5}}}, 0),
    ({"max_workers": 3, "available_node_types": {"g": {"resources": {"GPU": 4}}}}, 12),  # bounded by the cluster max
    ({"head_node_type": "h", "available_node_types": {"h": {"resources": {"GPU": 1}, "max_workers": 0}}}, 1),
    ({"available_node_types": {"g": {"resources": {"GPU": 8}, "max_workers": 0}}}, 0),
    ({"available_node_types": {"local.cluster.node": {"resources": {}, "node_config": {}}}}, 0),  # ray up, local
])
def test_launchable_gpus(config, expected):
    assert launchable_from_config(config)[0] == expected


def test_capacity_reads_the_head_bootstrap_config(tmp_path, monkeypatch):
    monkeypatch.setattr("cluster.ray_adapter.cluster_view.reported_max_resources", lambda: None)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert gpu_capacity(0) == GpuCapacity(0, 0.0, "none")
    config = bootstrapped(yaml.safe_load((REPO / "ray_cluster.yaml").read_text()), 4)
    (tmp_path / "ray_bootstrap_config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    cap = gpu_capacity(0)
    assert cap.launchable == 40 and cap.gpu_node_types == ("gpu_spot", "gpu_ondemand")
    assert "autoscaler can launch 40 (gpu_spot, gpu_ondemand" in cap.describe()


def test_capacity_prefers_what_the_autoscaler_reported(monkeypatch, tmp_path):
    monkeypatch.setattr("cluster.ray_adapter.cluster_view.reported_max_resources", lambda: {"GPU": 16.0, "CPU": 64.0})
    monkeypatch.setenv("HOME", str(tmp_path))
    cap = gpu_capacity(1)
    assert (cap.now, cap.launchable, cap.source) == (1, 16.0, "GCS cluster config")
    assert cap.describe() == "1 GPU(s) up now"


def test_a_broken_config_file_means_no_launchable_gpus(tmp_path, monkeypatch):
    monkeypatch.setattr("cluster.ray_adapter.cluster_view.reported_max_resources", lambda: None)
    bad = tmp_path / "cfg.yaml"
    bad.write_text("available_node_types: [unclosed")
    monkeypatch.setenv(CONFIG_ENV, str(bad))
    assert gpu_capacity(0).launchable == 0
