"""ray_cluster.yaml for the rehearsal: the AWS file with only the cloud swapped out.

What changes, and nothing else:
- ``provider``: Ray's ``local`` provider with the head's and the workers' addresses (one
  network namespace each), instead of AWS; so ``available_node_types``/``head_node_type``
  go (the local provider has a single node type) and ``max_workers`` is the worker count;
- ``auth.ssh_private_key``: the key the rehearsal made (the user name stays the AWS one);
- ``file_mounts``: the project's folder by absolute path, so `ray up` may run from anywhere;
- ``cluster_name``: its own, so a rehearsal never touches a real cluster's state.

The setup commands, every start command, the spot watcher and the token handling are the
AWS file's own. The rehearsal's nodes differ from EC2 instances in their image (the
packages are preinstalled, see ``cluster.rehearsal.cloud``), not in the config.
"""

from __future__ import annotations

import copy
from pathlib import Path

PROJECT_MOUNT = "~/elastic-train"


def rehearsal_config(aws: dict, head_ip: str, worker_ips: list[str], ssh_private_key: str, project_dir: Path,
                     cluster_name: str = "elastic-train-rehearsal") -> dict:
    """The rendered config; ``aws`` is ray_cluster.yaml as loaded."""
    config = copy.deepcopy(aws)
    config["cluster_name"] = cluster_name
    config["provider"] = {"type": "local", "head_ip": head_ip, "worker_ips": list(worker_ips)}
    config["auth"] = {**aws["auth"], "ssh_private_key": ssh_private_key}
    for key in ("available_node_types", "head_node_type"):
        config.pop(key, None)
    config["max_workers"] = len(worker_ips)
    config["min_workers"] = len(worker_ips)
    mounts = dict(aws["file_mounts"])
    if mounts.get(PROJECT_MOUNT) == ".":
        mounts[PROJECT_MOUNT] = str(project_dir)
    config["file_mounts"] = mounts
    return config


def differences(aws: dict, rendered: dict) -> set[str]:
    """Top-level keys whose values differ: what a test checks stays within the list above."""
    keys = set(aws) | set(rendered)
    return {k for k in keys if aws.get(k) != rendered.get(k)}
