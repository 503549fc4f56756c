"""What GPUs a cluster has now and what it can launch: the facts behind ``use_gpu: auto``.

A cluster whose GPU nodes scale from zero (``gpu_spot`` at ``min_workers: 0``) shows no GPU
until a job asks for one, so "has GPUs now" is the wrong test: a default job would train
with gloo on the head's CPUs and never make a GPU node launch. The autoscaler's node types
say what can be launched. Ray's launcher writes them, resources filled in from the instance
types, to ``~/ray_bootstrap_config.yaml`` on the head, where `ray job submit` runs a job's
driver; an autoscaler that reports its node groups to the GCS (KubeRay, autoscaler v2) is
read through Ray's own call for the same question.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import yaml

BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"  # where `ray up` leaves the autoscaling config on the head
CONFIG_ENV = "ETRAIN_AUTOSCALING_CONFIG"  # another path to it, e.g. for a head not started by `ray up`


@dataclass(frozen=True)
class GpuCapacity:
    """GPUs up now, GPUs the autoscaler may add, and where that came from (for messages)."""

    now: float
    launchable: float
    source: str  # "none", "GCS cluster config" or the config file's path
    gpu_node_types: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.now > 0:
            return f"{self.now:g} GPU(s) up now"
        if self.launchable > 0:
            types = ", ".join(self.gpu_node_types) or "GPU node groups"
            return f"no GPU up now, but the autoscaler can launch {self.launchable:g} ({types}; from {self.source})"
        return "no GPU up now and no GPU node type the autoscaler can launch"


def launchable_from_config(config: dict) -> tuple[float, tuple[str, ...]]:
    """GPUs the autoscaler may launch per an autoscaling config, and the node types that hold them.

    Each type counts ``max_workers`` nodes (a type without one is bounded by the cluster's
    ``max_workers``); the head type counts its one node.
    """
    types = config.get("available_node_types") or {}
    cluster_max = int(config.get("max_workers", 0) or 0)
    head = config.get("head_node_type")
    total, names = 0.0, []
    for name, node_type in types.items():
        gpus = float((node_type.get("resources") or {}).get("GPU", 0) or 0)
        count = 1 if name == head else int(node_type.get("max_workers", cluster_max) or 0)
        if gpus > 0 and count > 0:
            total += gpus * count
            names.append(name)
    return total, tuple(names)


def config_path() -> Path:
    return Path(os.path.expanduser(os.environ.get(CONFIG_ENV) or BOOTSTRAP_CONFIG))


def gpu_capacity(gpus_now: float) -> GpuCapacity:
    """The connected cluster's GPU capacity (call with ``ray.cluster_resources().get("GPU", 0)``)."""
    from cluster.ray_adapter.cluster_view import reported_max_resources

    reported = reported_max_resources()
    if reported and reported.get("GPU", 0) > 0:
        return GpuCapacity(gpus_now, reported["GPU"], "GCS cluster config")
    path = config_path()
    if path.is_file():
        try:
            config = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            config = {}
        launchable, names = launchable_from_config(config)
        if launchable > 0:
            return GpuCapacity(gpus_now, launchable, str(path), names)
    return GpuCapacity(gpus_now, 0.0, "none")
