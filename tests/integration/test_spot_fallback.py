"""Spot first, on-demand when spot cannot be had: Ray's autoscaler with ray_cluster.yaml's node types.

Ray's fake multi-node provider launches real raylets with fake GPUs. The node types are the
shipped file's (resources, max_workers), only the spot type's max is cut to 1 so
that a 2-worker job cannot have all its GPUs from spot. The head is started by the test
in a session of its own, on its own port, with a fresh HOME holding the autoscaling config
where `ray up` puts it; the test stops that session's processes and nothing else (Ray's
`AutoscalingCluster` helper would run `ray stop --force`, killing every Ray here).

A default quickstart job (``use_gpu: auto``) is submitted with no GPU node up: it must ask
for GPUs, so the autoscaler launches a spot GPU node, then an on-demand one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from conftest import free_port
from processes import session_pids, stop_session
from waiting import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.no_dashboard]  # its head is its own, not the shared Ray
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
HEAD_TYPE = "ray.head.default"  # the fake provider's name for the head type


def fake_config(aws: dict, gcs_port: int, spot_max: int) -> dict:
    """The fake provider's config with ray_cluster.yaml's worker types, GPUs made explicit
    (on AWS Ray fills them in from the instance type)."""
    types = {}
    for name, node_type in aws["available_node_types"].items():
        if name == aws["head_node_type"]:
            continue
        types[name] = {"resources": {**node_type["resources"], "CPU": 1, "GPU": 1}, "node_config": {},
                       "min_workers": node_type.get("min_workers", 0), "max_workers": node_type["max_workers"],
                       "priority": node_type.get("priority", 0)}
    types["gpu_spot"]["max_workers"] = spot_max
    types[HEAD_TYPE] = {"resources": {"CPU": 2, "head": 1}, "node_config": {}, "max_workers": 0}
    return {
        "cluster_name": "fake-spot-fallback", "max_workers": 10, "upscaling_speed": 1.0, "idle_timeout_minutes": 5,
        "provider": {"type": "fake_multinode", "gcs_address": f"127.0.0.1:{gcs_port}", "launch_multiple": True,
                     "head_node_id": "fffffffffffffffffffffffffffffffffffffffffffffffffff00000"},
        "auth": {"ssh_user": "ubuntu"}, "available_node_types": types, "head_node_type": HEAD_TYPE,
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


@pytest.fixture
def fake_cloud(tmp_path):
    aws = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())
    gcs_port, dash_port = free_port(), free_port()
    home = tmp_path / "head-home"
    home.mkdir()
    config = home / "ray_bootstrap_config.yaml"  # where `ray up` leaves it on the head
    config.write_text(yaml.safe_dump(fake_config(aws, gcs_port, spot_max=1)))
    # Autoscaler v1: v2 cannot load the fake provider's defaults (the wheel lacks its example.yaml).
    # v1 ignores `priority` and picks spot by type name; that spot comes first by priority, as
    # AWS's v2 does, is shown against Ray's v2 scheduler in tests/unit/test_spot_priority.py.
    env = {**os.environ, "HOME": str(home), "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
           "RAY_enable_autoscaler_v2": "0",
           "RAY_AUTH_MODE": "disabled", "PATH": f"{BIN}:{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "fixtures")])}
    env.pop("RAY_ADDRESS", None)
    temp = Path(tempfile.mkdtemp(prefix="etr-", dir="/tmp"))  # short: Ray's Unix socket paths must fit
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs_port}", "--node-ip-address=127.0.0.1",
         "--num-cpus=2", "--resources={\"head\": 1}", f"--autoscaling-config={config}", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dash_port}", "--ray-client-server-port", str(free_port()),
         # Its own agent ports: Ray's defaults may still be held by a Ray another test just stopped.
         f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
         f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
         # its own temp dir: `ray start` records its address in <temp>/ray/ray_current_cluster,
         # and /tmp/ray's is what other Rays on this machine (and `etrain run`) look up
         f"--temp-dir={temp}"],
        env=env, stdout=open(tmp_path / "head.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{dash_port}"
        client = wait_for(lambda: _client(url) or (head.poll() is not None and pytest.fail(
            f"the fake head exited: {(tmp_path / 'head.log').read_text()[-3000:]}")), 120, "the fake head's Jobs API",
            poll_s=1)
        yield client, url, temp
    finally:
        stop_session(head.pid)
        head.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)
        assert not session_pids(head.pid), "every process of the fake cluster is stopped"


def _client(url: str):
    from ray.job_submission import JobSubmissionClient

    try:
        client = JobSubmissionClient(url)
        client.list_jobs()
        return client
    except Exception:  # boundary: the head is still starting
        return None


def gpu_nodes(url: str) -> list[dict] | None:
    """The alive GPU nodes by start, or None while the head's state API does not answer."""
    import requests
    from ray.util.state import list_nodes

    try:
        listed = list_nodes(address=url, detail=True)
    except requests.ConnectionError:
        return None
    nodes = [n for n in listed if n.state == "ALIVE" and n.resources_total.get("GPU", 0) > 0]
    return sorted(({"market": "spot" if "spot" in n.resources_total else "ondemand", "start": n.start_time_ms}
                   for n in nodes), key=lambda n: n["start"])


def submit_quickstart(client, storage: Path, workers: int) -> str:
    """Submit under a fixed id, so a retry after a dropped connection cannot start it twice."""
    import requests

    job = f"quickstart-{workers}"
    for attempt in range(30):
        try:
            return client.submit_job(
                submission_id=job,
                entrypoint=f"{sys.executable} -m trainers.train {REPO / 'configs' / 'quickstart.yaml'} "
                           f"--set checkpoint.storage_root={storage} --set distributed.num_workers={workers}",
                runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
        except requests.ConnectionError:  # the head's dashboard dropped the connection (busy machine)
            time.sleep(2)
        except RuntimeError as exc:
            if "already exists" in str(exc):  # a retry after the first try got through
                return job
            if "try again later" not in str(exc):  # e.g. "No available agent": the head's agent is starting
                raise
            time.sleep(2)
    pytest.fail("the fake head's Jobs API dropped every submission")


def test_default_job_launches_spot_gpus_first_then_on_demand(fake_cloud, tmp_path):
    client, url, temp = fake_cloud
    assert wait_for(lambda: (lambda n: n is not None and [n])(gpu_nodes(url)), 60, "the state API") == [[]], \
        "no GPU node before the job"
    job = submit_quickstart(client, tmp_path / "storage", workers=2)
    try:
        launched = wait_for(lambda: (lambda n: n if n and len(n) >= 2 else None)(gpu_nodes(url)), 180,
                            "two GPU nodes", poll_s=1)
        logs = wait_for(lambda: (lambda text: text if "the autoscaler launches them" in text else None)(
            client.get_job_logs(job)), 60, "the job's GPU decision")
    except AssertionError as exc:
        monitor = sorted(temp.glob("session_*/logs/monitor.*"))
        raise AssertionError(f"{exc}\njob: {client.get_job_logs(job)[-3000:]}\n"
                             f"autoscaler: {monitor[-1].read_text()[-3000:] if monitor else 'no log'}") from None
    finally:
        client.stop_job(job)
    assert "no GPU node is up yet: the job asks for GPUs and the autoscaler launches them" in logs
    # One GPU per worker: spot up to its max_workers (1 here), on-demand for the rest.
    assert sorted(n["market"] for n in launched) == ["ondemand", "spot"], launched
