"""The shipped ray_cluster.yaml on a cloud rehearsed on one machine (cluster.rehearsal).

One cloud per test session: a head and three workers, each a network namespace with its own
address, Unix user, empty home, process tree and sshd; a fake IMDS at 169.254.169.254 inside
each worker. The launching side is fresh too (its own empty HOME): it makes the token as the
README says, runs the real `ray up` on the rendered file, reaches the Jobs API through
`ray dashboard`'s SSH tunnel, and submits with `ray job submit --working-dir`. Checkpoints go
to a moto S3 server on the bridge's host address, reachable from every node.

The chaos runs in one elastic job: a spot notice on one training node (its spot watcher,
started by the worker start command, drains it; the node is terminated at the deadline, as
AWS does), then another training node's network is cut. The job finishes at its target step
on the node left.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dashboard import dashboard_get
from processes import start_time
from waiting import wait_for

from cluster.rehearsal.cloud import Cloud, RehearsalError
from cluster.rehearsal.render import rehearsal_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
BUCKET = "rehearsal"
TARGET_STEP = 3000
STEP_DELAY_S = 0.02  # 3000 steps on 2 workers last at least 60 s


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Launcher:
    """The user's machine: a fresh HOME, Ray's CLI, the rendered cluster file."""

    def __init__(self, home: Path, config: Path):
        self.home, self.config = home, config
        self.env = {**os.environ, "HOME": str(home), "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_AUTH_MODE": "token",
                    "RAY_UP_enable_autoscaler_v2": "0",  # see cluster.rehearsal.cloud: the local provider under v2
                    # The launcher's own temporary folder: `ray up` keeps the local provider's cluster
                    # state there, and this machine's /tmp/ray belongs to the Ray of other tests.
                    "TMPDIR": str(home / "tmp"), "RAY_TMPDIR": str(home / "tmp")}
        (home / "tmp").mkdir()
        self.env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # nodes have real addresses here
        self.env.pop("RAY_ADDRESS", None)
        self.tunnel: subprocess.Popen | None = None
        self.dashboard = ""

    def ray(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(BIN / "ray"), *args], capture_output=True, text=True, env=self.env,
                              timeout=timeout, cwd=REPO)
        if check:
            assert proc.returncode == 0, f"ray {' '.join(args)}:\n{(proc.stdout + proc.stderr)[-4000:]}"
        return proc

    def open_tunnel(self) -> None:
        port = free_port()
        self.tunnel = subprocess.Popen([str(BIN / "ray"), "dashboard", str(self.config), "--port", str(port)],
                                       env=self.env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       start_new_session=True)
        self.dashboard = f"http://127.0.0.1:{port}"

    def api(self, path: str, params: dict | None = None) -> dict | None:
        """GET from the head's dashboard through the tunnel, with this machine's token; None while it
        does not answer. The test's polls go this way (tests/fixtures/dashboard.py says why)."""
        return dashboard_get(self.dashboard + path, self.home / ".ray" / "auth_token", params)

    def close_tunnel(self) -> None:
        if self.tunnel and self.tunnel.poll() is None:
            os.killpg(self.tunnel.pid, signal.SIGTERM)
            self.tunnel.wait(timeout=20)


def listed(launcher: Launcher, resource: str, **equal: str) -> list[dict] | None:
    """Ray's state API (`ray list <resource>`) through the tunnel; None while the head does not answer."""
    body = launcher.api(f"/api/v0/{resource}", {"limit": 1000, "filter_keys": list(equal),
                                                "filter_predicates": ["="] * len(equal),
                                                "filter_values": list(equal.values())})
    return body["data"]["result"]["result"] if body and body.get("result") else None


def alive_node_ips(launcher: Launcher) -> list[str] | None:
    nodes = listed(launcher, "nodes", state="ALIVE")
    return None if nodes is None else sorted(n["node_ip"] for n in nodes)


def training_node_ips(launcher: Launcher) -> list[str] | None:
    """The addresses of the nodes that hold a live Ray Train worker, one entry per worker."""
    nodes, actors = listed(launcher, "nodes", state="ALIVE"), listed(launcher, "actors", class_name="RayTrainWorker",
                                                                      state="ALIVE")
    if nodes is None or actors is None:
        return None
    ips = {n["node_id"]: n["node_ip"] for n in nodes}
    return sorted(ips[a["node_id"]] for a in actors if a["node_id"] in ips)


@pytest.fixture(scope="module")
def rehearsal():
    if os.geteuid() != 0:
        pytest.fail("the rehearsal needs root (network namespaces); CI runs as root")
    from moto.server import ThreadedMotoServer

    base = Path(f"/var/tmp/etrain-rehearsal-{os.getpid()}")
    cloud = Cloud(base, workers=3)
    moto = launcher = None
    try:
        started = time.monotonic()
        cloud.start()
        moto_port = free_port(cloud.host_ip)
        moto = ThreadedMotoServer(ip_address=cloud.host_ip, port=moto_port)
        moto.start()
        s3 = {"AWS_ENDPOINT_URL": f"http://{cloud.host_ip}:{moto_port}", "AWS_ACCESS_KEY_ID": "testing",
              "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}
        import boto3

        boto3.client("s3", endpoint_url=s3["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=BUCKET)
        aws = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())
        config = base / "cluster.yaml"
        config.write_text(yaml.safe_dump(rehearsal_config(
            aws, cloud.head.ip, [n.ip for n in cloud.nodes[1:]], str(cloud.key), REPO)))
        home = base / "launcher"
        home.mkdir()
        launcher = Launcher(home, config)
        assert not (home / ".ray" / "auth_token").exists()
        launcher.ray("get-auth-token", "--generate")  # the README's first step
        (home / ".ray" / "auth_token").chmod(0o600)
        up = launcher.ray("up", "-y", "--no-config-cache", str(config), timeout=900)
        launcher.open_tunnel()  # the head is up: its dashboard answers through `ray dashboard`'s tunnel
        wait_for(lambda: launcher.api("/api/jobs/") is not None, 120, "the Jobs API through the tunnel", poll_s=1)
        nodes = wait_for(lambda: (lambda ips: ips if ips and len(ips) == 4 else None)(alive_node_ips(launcher)),
                         420, "the head and 3 workers to join", poll_s=2)
        print(f"rehearsal cloud up in {time.monotonic() - started:.0f}s")
        yield type("Rehearsal", (), {"cloud": cloud, "launcher": launcher, "s3": s3, "up": up, "nodes": nodes})
    finally:
        if launcher:
            launcher.close_tunnel()
        if moto:
            moto.stop()
        cloud.stop()
        assert cloud.pids() == [], "no process of any node is left"


def test_ray_up_brings_up_head_and_workers_with_one_token(rehearsal):
    cloud, launcher = rehearsal.cloud, rehearsal.launcher
    assert rehearsal.nodes == sorted(n.ip for n in cloud.nodes)
    token = (launcher.home / ".ray" / "auth_token").read_text().strip()
    for node in cloud.nodes:
        copy = node.home / ".ray" / "auth_token"
        assert copy.read_text().strip() == token, node.name
        assert copy.stat().st_mode & 0o077 == 0 and copy.stat().st_uid == node.uid, "only the node's user reads it"
    # Token auth is on at the head: the Jobs API refuses no token and a wrong one, takes ours.
    import requests

    jobs = f"{launcher.dashboard}/api/jobs/"
    assert requests.get(jobs, timeout=30).status_code == 401
    assert requests.get(jobs, headers={"Authorization": "Bearer not-the-token"}, timeout=30).status_code in (401, 403)
    assert requests.get(jobs, headers={"Authorization": f"Bearer {token}"}, timeout=30).status_code == 200


def s3_fs(s3: dict):
    import pyarrow.fs as pafs

    return pafs.S3FileSystem(endpoint_override=s3["AWS_ENDPOINT_URL"].removeprefix("http://"), scheme="http",
                             access_key="testing", secret_key="testing", region="us-east-1")


def read_json(fs, path: str):
    import pyarrow.fs as pafs

    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(path) as f:
        return json.loads(f.read())


def checkpoint_steps(fs, run: str) -> list[int]:
    import pyarrow.fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(f"{BUCKET}/runs/{run}/checkpoints", allow_not_found=True))
    return sorted(int(i.base_name.rsplit("_", 1)[1]) for i in infos
                  if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_"))


def test_elastic_job_survives_a_spot_notice_and_a_lost_node(rehearsal):
    cloud, launcher, s3 = rehearsal.cloud, rehearsal.launcher, rehearsal.s3
    job, name = "rehearsal-chaos", "chaos"
    launcher.ray(
        "job", "submit", "--address", launcher.dashboard, "--no-wait", "--submission-id", job,
        "--working-dir", ".", "--runtime-env-json", json.dumps({"env_vars": {**s3, "PYTHONPATH": "tests/fixtures"}}),
        "--", "python3", "-m", "trainers.train", "configs/quickstart.yaml",
        "--set", f"name={name}", "--set", f"checkpoint.storage_root=s3://{BUCKET}/runs",
        # Each step on 2 workers sleeps: the job outlasts the notice, the restart and the cut on a machine
        # of any speed (at full speed the quickstart ran its 3000 steps before the notice could be
        # served); on the one node left after the cut it runs at full speed to its target.
        "--set", "model.factory=userpkg:slow_model",
        "--set", f"model.options={{delay_s: {STEP_DELAY_S}, slow_from_world_size: 2}}",
        "--set", "data.source=null", "--set", "data.factory=userpkg:make_data", "--set", "data.options={n: 3000}",
        "--set", "distributed.num_workers={min: 1, max: 2}", "--set", f"training.max_steps={TARGET_STEP}",
        "--set", "training.epochs=1000", "--set", "checkpoint.interval=500", "--set", "checkpoint.num_to_keep=10",
        timeout=180)
    fs = s3_fs(s3)
    by_ip = {n.ip: n for n in cloud.nodes}
    started = time.monotonic()

    def phase(what: str) -> None:  # shown with a failure: where the time went
        print(f"[rehearsal] {time.monotonic() - started:5.0f}s {what}")

    def logs() -> str:
        return launcher.ray("job", "logs", "--address", launcher.dashboard, job, check=False, timeout=60).stdout

    def job_status() -> str:
        body = launcher.api(f"/api/jobs/{job}")
        return body["status"].lower() if body else ""

    try:
        wait_for(lambda: checkpoint_steps(fs, name), 300, "the first checkpoint", poll_s=1)
        phase("first checkpoint")
        first = wait_for(lambda: (lambda ips: ips if ips and len(ips) == 2 else None)(training_node_ips(launcher)),
                         120, "2 training workers", poll_s=1)
        assert cloud.head.ip not in first, "training runs on the workers, as GPU workers do on AWS"
        spot = by_ip[first[0]]
        cloud.interrupt(spot, deadline_s=25)
        phase(f"spot notice served on {spot.name}")
        wait_for(lambda: "draining this node" in (spot.tmp / "etrain-spot-watch.log").read_text(), 60,
                 "the spot watcher to drain its node", poll_s=1)
        assert "this node is " in (spot.tmp / "etrain-spot-watch.log").read_text()
        records = wait_for(lambda: read_json(fs, f"{BUCKET}/runs/{name}/interruptions.json"), 180,
                           "the interruption record", poll_s=1)
        cloud.kill(spot)  # the instance is terminated at the notice's deadline
        phase(f"interruption recorded, {spot.name} terminated")
        assert records[0]["cause"] == "preemption notice", records
        assert records[0]["steps_lost"] <= 1, records
        second = wait_for(lambda: (lambda ips: ips if ips and spot.ip not in ips and len(ips) == 2 else None)(
            training_node_ips(launcher)), 240, "training on the 2 nodes left", poll_s=1)
        # Cut at once: each step all-reduces with every rank, so the job cannot reach its target
        # without noticing the lost node, however fast it steps.
        cloud.cut_network(by_ip[second[0]])
        phase(f"training on 2 nodes again; network of {by_ip[second[0]].name} cut")
        status = wait_for(lambda: (lambda s: s if any(w in s for w in ("succeeded", "failed", "stopped")) else None)(
            job_status()), 480, "the job to end", poll_s=2)
        phase(f"job ended: {status.strip()[-60:]}")
        text = logs()
        assert "succeeded" in status, status + text[-4000:]
    finally:
        launcher.ray("job", "stop", "--address", launcher.dashboard, job, check=False, timeout=60)
    summary = read_json(fs, f"{BUCKET}/runs/{name}/summary.json")
    assert summary["status"] == "succeeded" and summary["final_step"] == TARGET_STEP, summary
    causes = [r["cause"] for r in summary["interruptions"]]
    assert causes[0] == "preemption notice" and "node lost" in causes[1:], summary["interruptions"]
    assert summary["world_size"] == 1


def test_nothing_is_left_running_after_the_cloud_stops():
    """A small cloud of its own: after stop, no namespace, node user process, sshd or bridge remains."""
    cloud = Cloud(Path(f"/var/tmp/etrain-rehearsal-stop-{os.getpid()}"), workers=1, prefix="etz", subnet="10.77.1",
                  first_uid=27200)
    with cloud:
        cloud.ssh(cloud.nodes[1], "nohup sleep 600 > /dev/null 2>&1 &")
        # A process listed may be gone before its start time is read (the ssh session that started
        # the sleep): only those seen running are checked, or "gone" would match "gone" below.
        running = {pid: started for pid in cloud.pids() if (started := start_time(pid)) is not None}
        assert len(running) >= 3, "each node's sshd and the worker's sleep are seen"
    assert cloud.pids() == []
    for pid, started in running.items():
        assert start_time(pid) != started, f"process {pid} still runs"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n.netns in listed for n in cloud.nodes)
    assert subprocess.run(["ip", "link", "show", "etz-br0"], capture_output=True).returncode != 0
    assert not any(Path("/etc/netns", n.netns).exists() for n in cloud.nodes)
    assert not cloud.base.exists()


def test_a_cloud_that_fails_half_way_is_cleaned_up():
    """The second worker cannot be made: what the first node and the head started is still stopped."""

    class Failing(Cloud):
        def _make_node(self, node):
            if node.name == "w2":
                raise RuntimeError("no capacity")
            super()._make_node(node)

    cloud = Failing(Path(f"/var/tmp/etrain-rehearsal-fail-{os.getpid()}"), workers=2, prefix="ety", subnet="10.77.2",
                    first_uid=27300)
    with pytest.raises(RuntimeError, match="no capacity"):
        cloud.__enter__()
    started = [n for n in cloud.nodes if n.launcher]
    assert len(started) == 2 and all(n.launcher.poll() is not None for n in started)
    assert cloud.pids() == []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "ety-" not in listed and not cloud.base.exists()


def test_two_clouds_cannot_share_node_users():
    with Cloud(Path(f"/var/tmp/etrain-rehearsal-a-{os.getpid()}"), workers=1, prefix="eta", subnet="10.77.3",
               first_uid=27400) as first:
        first.ssh(first.nodes[1], "nohup sleep 600 > /dev/null 2>&1 &")
        second = Cloud(Path(f"/var/tmp/etrain-rehearsal-b-{os.getpid()}"), workers=1, prefix="etb",
                       subnet="10.77.4", first_uid=27400)
        with pytest.raises(RehearsalError, match="another rehearsal"):
            second.start()
        assert first.pids(), "the first cloud's processes are untouched"
