"""One-box use of the cluster path: `ray up` on the local twin over a real sshd, `ray job submit`.
The node's environment is baked from this venv, as a node image would hold it (see baked_node_env).

(The real thing, fresh nodes with their own addresses, users and homes, is tests/e2e/test_rehearsal.py.)

The test starts its own sshd on 127.0.0.1:22 with host and user keys it makes (`make test`
installs openssh-server and rsync), runs Ray's own CLI against it, and stops every process
it started by pid: sshd, and the head's Ray that `ray down` leaves running.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from dashboard import dashboard_get
from processes import session_pids, start_time, stop_all
from waiting import wait_for

from cluster.twin import local_twin

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SSHD = "/usr/sbin/sshd"


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def pids_running_from(folder: Path) -> set[int]:
    """Processes whose command line runs from ``folder``: everything the twin's head started
    lives in the node's own environment under the test's temporary folder."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return {int(line.split()[0]) for line in out.splitlines() if str(folder) in line}


def twin_pids(folder: Path) -> set[int]:
    """The twin head's processes: those that run from ``folder`` and every process of their sessions
    (each `ray start` over ssh runs in a session of its own). Ray's agents rename themselves
    (`ray::DashboardAgent`), so their command line names no folder; one left behind its raylet spins
    at ~50% of a core for a minute or more, reporting the raylet's death to a GCS that is gone, and
    holds Ray's default agent port, which the next local Ray on this machine needs."""
    pids = pids_running_from(folder)
    sessions = set()
    for pid in pids:
        try:
            sessions.add(os.getsid(pid))
        except ProcessLookupError:
            continue
    sessions.discard(os.getsid(0))  # never this test's own session
    return pids | {pid for sid in sessions for pid in session_pids(sid)}


def baked_node_env(env_dir: Path) -> None:
    """The node's environment as a node image holds it: this venv's packages, hard-linked (seconds,
    where pip takes minutes to unpack torch and Ray), its scripts pointed at the new interpreter.
    The twin's setup commands still run, find the pins installed and install the project.
    A venv reached through a symlink (a git worktree sharing one) is copied as the folder it names:
    a copied link would run the node's Ray from this venv, where the stop by folder misses it."""
    prefix = Path(sys.prefix).resolve()
    cp = subprocess.run(["cp", "-al", str(prefix), str(env_dir)], capture_output=True, text=True)
    if cp.returncode != 0:  # another filesystem: hard links cannot cross it
        shutil.rmtree(env_dir, ignore_errors=True)
        subprocess.run(["cp", "-a", str(prefix), str(env_dir)], check=True)
    old, new = f"#!{prefix}/bin/python".encode(), f"#!{env_dir}/bin/python".encode()
    for script in (env_dir / "bin").iterdir():
        if script.is_file() and not script.is_symlink():
            text = script.read_bytes()
            if text.startswith(old):
                script.unlink()  # a new file: the hard link to this venv's script stays as it was
                script.write_bytes(new + text[len(old):])
                script.chmod(0o755)


@pytest.fixture
def sshd(tmp_path):
    if not (os.path.exists(SSHD) and shutil.which("rsync")):
        pytest.fail("openssh-server and rsync are needed: `make test` installs them (bash tests/system_packages.sh)")
    if port_open(22):
        pytest.fail("something already listens on 127.0.0.1:22; this test runs its own sshd there")
    if port_open(8265):  # the twin's head binds its dashboard there, with no retries
        pytest.fail("another Ray's dashboard holds 127.0.0.1:8265; the twin's head needs it: run this test alone")
    d = tmp_path / "ssh"
    d.mkdir()
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "user_key.pub").read_text())
    (d / "authorized_keys").chmod(0o600)
    config = d / "sshd_config"
    config.write_text(
        f"ListenAddress 127.0.0.1\nPort 22\nHostKey {d / 'host_key'}\nPidFile {d / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {d / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        "MaxSessions 50\nMaxStartups 50\nSubsystem sftp internal-sftp\n")
    Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stderr=open(d / "sshd.log", "w"))
    for _ in range(50):
        if port_open(22):
            break
        time.sleep(0.1)
    yield d / "user_key"
    proc.terminate()
    proc.wait(timeout=10)


ENDED = ("SUCCEEDED", "FAILED", "STOPPED")


def jobs_api(path: str) -> dict | list | None:
    """The head's Jobs API, with the token `ray get-auth-token` made; None while it does not answer."""
    return dashboard_get(f"http://127.0.0.1:8265/api/jobs/{path}", Path.home() / ".ray" / "auth_token")


@pytest.mark.timeout(1800)  # `ray up` installs the node's environment: minutes on a fresh machine
def test_ray_up_then_job_submit_then_ray_down(sshd, tmp_path):
    node_dir = tmp_path / "node"
    storage = tmp_path / "storage"
    twin = local_twin(yaml.safe_load((REPO / "ray_cluster.yaml").read_text()), ssh_user=os.environ.get("USER", "root"),
                      ssh_private_key=str(sshd), target_dir=str(node_dir))
    twin["file_mounts"] = {str(node_dir): str(REPO)}
    config = tmp_path / "twin.yaml"
    config.write_text(yaml.safe_dump(twin))
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    ray = str(BIN / "ray")
    node_dir.mkdir()
    baked_node_env(node_dir / ".node-venv")
    try:
        started = time.time()
        # The README's first step: one box, one user, so the head reads this very token.
        subprocess.run([ray, "get-auth-token", "--generate"], check=True, capture_output=True, env=env, timeout=60)
        up = subprocess.run([ray, "up", "-y", "--no-config-cache", str(config)], capture_output=True, text=True,
                            env=env, timeout=1200)
        print(f"ray up took {time.time() - started:.0f}s")
        assert up.returncode == 0, (up.stdout + up.stderr)[-4000:]
        node_python = node_dir / ".node-venv" / "bin" / "python"
        assert node_python.exists()
        job_env = {**env, "RAY_AUTH_MODE": "token"}
        # The head's dashboard answers a little after `ray up` returns.
        wait_for(lambda: jobs_api("") is not None, 120, "the head's Jobs API", poll_s=1)
        for _ in range(30):
            submit = subprocess.run(
                [ray, "job", "submit", "--address", "http://127.0.0.1:8265", "--no-wait", "--submission-id",
                 "quickstart-e2e", "--", str(node_python), "-m", "trainers.train",
                 str(node_dir / "configs" / "quickstart.yaml"), "--set", f"checkpoint.storage_root={storage}",
                 "--set", "training.epochs=2"],
                capture_output=True, text=True, env=job_env, timeout=120)
            said = submit.stdout + submit.stderr
            # The dashboard answers before the head's node agent has registered (on a busy machine,
            # seconds later): Ray then says "No available agent to submit job, please try again later".
            if submit.returncode == 0 or "try again later" not in said:
                break
            time.sleep(2)
        assert submit.returncode == 0, said
        status = wait_for(lambda: (lambda job: job["status"] if job and job["status"] in ENDED else None)(
            jobs_api("quickstart-e2e")), 300, "the job to end", poll_s=1)
        got = subprocess.run([ray, "job", "logs", "--address", "http://127.0.0.1:8265", "quickstart-e2e"],
                             capture_output=True, text=True, env=job_env, timeout=60)
        logs = got.stdout + got.stderr
        assert status == "SUCCEEDED", status + logs[-3000:]
        assert "[etrain] job quickstart: succeeded" in logs
        summary = json.loads((storage / "quickstart" / "summary.json").read_text())
        assert summary["status"] == "succeeded"
        assert (Path(summary["checkpoint_uri"]) / "manifest.json").exists()
    finally:
        try:
            down = subprocess.run([ray, "down", "-y", str(config)], capture_output=True, text=True, env=env,
                                  timeout=300)
        finally:
            # `ray down` leaves the head's Ray running (local provider). Its sessions are read once, while
            # its raylet still names them: an agent left behind it names neither folder nor raylet.
            twin = {pid: start_time(pid) for pid in twin_pids(node_dir)}

            def left() -> set[int]:
                return {pid for pid, started in twin.items() if started and start_time(pid) == started}

            stop_all(lambda: left() | twin_pids(node_dir))
    assert down.returncode == 0, down.stdout + down.stderr
    assert not left(), "every process the test started is stopped"
    assert not pids_running_from(node_dir)
