"""The local twin of ray_cluster.yaml: the same cluster, `local` provider, head at 127.0.0.1.

One box, one user. To rehearse the real thing on fresh nodes (several addresses, users and
homes), see ``cluster.rehearsal``.

Generated from ray_cluster.yaml so the two cannot drift: the same file mounts and start
commands, run on this machine over SSH. What differs, and why:

- provider ``local`` with the head at 127.0.0.1 and no workers (one box);
- the node installs the same pins into a virtual environment instead of the system Python,
  and every command runs with that environment first on PATH;
- Ray binds to 127.0.0.1 (``--node-ip-address``), as nothing here may face outward, and
  every process it starts (job drivers too) keeps 127.0.0.1 as is: Ray otherwise swaps a
  loopback address for the machine's outward one when connecting
  (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``);
- no NCCL settings and no spot watcher: no GPUs, no spot market;
- no token mount: the head runs as you, so your ``~/.ray/auth_token`` (made once with
  `ray get-auth-token --generate`) is its own; the head's start still checks it is there;
- no `ray stop` before `ray start`: on a shared box it would kill every Ray there, not
  just this cluster's (a fresh cloud node has nothing else to stop).

    python -m cluster.twin > cluster/local.yaml
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TARGET = "~/elastic-train"


def local_twin(aws: dict, ssh_user: str = "root", ssh_private_key: str = "~/.ssh/id_ed25519",
               target_dir: str = DEFAULT_TARGET, torch_spec: str = "torch==2.13.0") -> dict:
    """The local-provider config derived from the AWS one."""
    remote_dir = next(iter(aws["file_mounts"]))
    env_dir = f"{target_dir}/.node-venv"
    on_path = f"export PATH={env_dir}/bin:$PATH RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0;"

    def local(cmd: str) -> str:
        cmd = cmd.replace(remote_dir, target_dir)
        if "ray start" in cmd:
            cmd = cmd.replace("ray start", "ray start --node-ip-address=127.0.0.1")
        return f"{on_path} {cmd}"

    twin = copy.deepcopy(aws)
    twin["cluster_name"] = f"{aws['cluster_name']}-local"
    twin["max_workers"] = 0
    twin["provider"] = {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []}
    twin["auth"] = {"ssh_user": ssh_user, "ssh_private_key": ssh_private_key}
    for key in ("available_node_types", "head_node_type", "docker"):
        twin.pop(key, None)
    twin["file_mounts"] = {target_dir: aws["file_mounts"][remote_dir]}
    pins = [c for c in aws["setup_commands"] if "pip install" in c]
    twin["setup_commands"] = [
        f"test -x {env_dir}/bin/python || python3 -m venv {env_dir}",
        f"{on_path} python3 -m pip install -q {torch_spec}",
        *[local(c) for c in pins],
    ]
    twin["head_start_ray_commands"] = [local(c) for c in aws["head_start_ray_commands"] if c.strip() != "ray stop"]
    twin["worker_start_ray_commands"] = []
    return twin


def render(twin: dict) -> str:
    head = "# Generated from ray_cluster.yaml by `python -m cluster.twin`; do not edit by hand.\n"
    return head + yaml.safe_dump(twin, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "ray_cluster.yaml"))
    parser.add_argument("--ssh-user", default="root")
    parser.add_argument("--ssh-private-key", default="~/.ssh/id_ed25519")
    parser.add_argument("--target-dir", default=DEFAULT_TARGET, help="where the node keeps the synced tree")
    args = parser.parse_args(argv)
    aws = yaml.safe_load(Path(args.config).read_text())
    sys.stdout.write(render(local_twin(aws, args.ssh_user, args.ssh_private_key, args.target_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
