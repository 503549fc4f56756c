"""ray_cluster.yaml and its local twin: Ray's own validation plus the rules we promise."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from cluster.twin import local_twin, render

REPO = Path(__file__).resolve().parents[2]
AWS = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())


@pytest.mark.parametrize("name", ["ray_cluster.yaml", "cluster/local.yaml"])
def test_passes_rays_validation(name):
    validate_config(prepare_config(yaml.safe_load((REPO / name).read_text())))


def test_gpu_workers_are_spot_with_on_demand_fallback():
    types = AWS["available_node_types"]
    markets = {name: t["node_config"].get("InstanceMarketOptions", {}).get("MarketType", "on-demand")
               for name, t in types.items() if name != AWS["head_node_type"]}
    assert "spot" in markets.values() and "on-demand" in markets.values(), markets
    head = types[AWS["head_node_type"]]["node_config"]
    assert "InstanceMarketOptions" not in head, "the head must be on-demand"


def test_ray_is_pinned_everywhere():
    setup = " ".join(AWS["setup_commands"])
    assert '"ray[default,train,tune,serve]==2.60.0"' in setup


def test_workers_start_the_spot_watcher():
    assert any("etrain spot-watch" in c for c in AWS["worker_start_ray_commands"])


def test_only_ssh_faces_the_internet():
    for rule in AWS["provider"]["security_group"]["IpPermissions"]:
        open_to_all = any(r.get("CidrIp") == "0.0.0.0/0" for r in rule.get("IpRanges", []))
        if open_to_all:
            assert (rule["FromPort"], rule["ToPort"]) == (22, 22), rule
    head = " ".join(AWS["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "RAY_AUTH_MODE=token" in head
    assert "--metrics-export-port=8080" in head


def test_nccl_settings_from_the_guide():
    setup = " ".join(AWS["setup_commands"])
    for var in ("TORCH_NCCL_BLOCKING_WAIT=1", "TORCH_NCCL_ASYNC_ERROR_HANDLING=1", "NCCL_SOCKET_IFNAME"):
        assert var in setup


def test_local_twin_is_generated_from_the_aws_file():
    assert (REPO / "cluster" / "local.yaml").read_text() == render(local_twin(AWS)), \
        "regenerate: python -m cluster.twin > cluster/local.yaml"
    twin = local_twin(AWS)
    assert twin["provider"] == {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []}
    start = twin["head_start_ray_commands"][-1]
    assert "--node-ip-address=127.0.0.1" in start and "--dashboard-host=127.0.0.1" in start


def test_token_is_carried_to_every_node_and_checked_before_the_head_starts():
    assert AWS["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    head = AWS["head_start_ray_commands"]
    check = next(i for i, c in enumerate(head) if "auth_token" in c)
    start = next(i for i, c in enumerate(head) if "ray start --head" in c)
    assert check < start and "ray get-auth-token --generate" in head[check]


def test_spot_watcher_connects_with_the_token():
    (watch,) = [c for c in AWS["worker_start_ray_commands"] if "etrain spot-watch" in c]
    assert "RAY_AUTH_MODE=token" in watch and "--node-id" not in watch, "it finds its own node"


def test_no_setup_command_needs_sudo():
    assert not any("sudo" in c for c in AWS["setup_commands"]), "a fresh node user may have no sudo"


def test_rehearsal_renders_only_the_provider_auth_key_and_mount():
    from cluster.rehearsal.render import differences, rehearsal_config

    rendered = rehearsal_config(AWS, "10.77.0.11", ["10.77.0.12", "10.77.0.13"], "/k/id", REPO)
    assert differences(AWS, rendered) == {"cluster_name", "provider", "auth", "available_node_types",
                                          "head_node_type", "max_workers", "min_workers", "file_mounts"}
    for key in ("setup_commands", "head_start_ray_commands", "worker_start_ray_commands", "rsync_exclude"):
        assert rendered[key] == AWS[key], key
    assert rendered["auth"] == {"ssh_user": AWS["auth"]["ssh_user"], "ssh_private_key": "/k/id"}
    assert rendered["file_mounts"] == {"~/elastic-train": str(REPO), "~/.ray/auth_token": "~/.ray/auth_token"}
    assert rendered["provider"] == {"type": "local", "head_ip": "10.77.0.11", "worker_ips": ["10.77.0.12", "10.77.0.13"]}
    validate_config(prepare_config(rendered))


def test_the_node_image_is_installed_with_uv_beside_this_python_else_pip(tmp_path, monkeypatch):
    from cluster.rehearsal import cloud

    python = tmp_path / "image" / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q"]
    monkeypatch.setattr(cloud.sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels /more/wheels")
    assert cloud.installers(python) == [pip]

    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "uv").touch()
    uv, then = cloud.installers(python)
    assert then == pip, "pip, with its own settings, where uv fails"
    assert uv[:3] == [str(tmp_path / "venv" / "bin" / "uv"), "pip", "install"]
    assert uv[uv.index("--python") + 1] == str(python), "into the image, not into this venv"
    assert [uv[i + 1] for i, a in enumerate(uv) if a == "--find-links"] == ["/opt/wheels", "/more/wheels"], \
        "uv does not read pip's settings"
    assert "--compile-bytecode" in uv, "PYTHONDONTWRITEBYTECODE machines would compile at every start"
    monkeypatch.delenv("PIP_FIND_LINKS")
    assert "--find-links" not in cloud.installers(python)[0]
