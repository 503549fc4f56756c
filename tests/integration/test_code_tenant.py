"""A `code` tenant's own code against the service's state (issue 13), deployed as it must be:
the service runs on a Ray of its own (token auth on, this test's Unix user, its state in a
folder only that user reads); jobs run on a jobs cluster apart, a Ray started by another Unix
user (`nobody`) with a token of its own, as another machine would be. Storage is S3 (moto).

The attacker's train loop is told nothing: it searches every folder it may read for records
and token hashes, reads every process's environment for a secret of the service's, and joins
every Ray whose GCS runs on this box to run a task there. Nothing of the service's is found,
its Ray refuses the attacker, a restart reads the state back unchanged, and the service
refuses to start when a `code` tenant's jobs would run on its own cluster.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import yaml

from conftest import REPO, free_port
from processes import stop_session
from waiting import wait_for

pytestmark = pytest.mark.ray

NOBODY = 65534
BUCKET = "etrain-code-tenant"
MARKER = f"svc-secret-{secrets.token_hex(8)}"  # in the service's environment only
TOKENS = {"mallory": ("crew-m", "code"), "bob": ("team-b", "user"), "root": ("ops", "admin")}


def token_of(who: str) -> str:
    return f"ct-{who}-0123456789abcdef"


def as_nobody(*argv: str) -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]


def others_may_run(path: str) -> bool:
    """Whether a user with no rights of ours may run ``path``: every folder on the way and the
    file itself are open to others (a probe run as that user can succeed through caches
    and still leave Ray's own child processes denied)."""
    real = Path(os.path.realpath(path))
    return all(p.stat().st_mode & stat.S_IXOTH for p in [real, *real.parents])


def jobs_python() -> Path:
    """A Python another user may run, with Ray and torch: this venv if `nobody` can run it,
    else the rehearsal's node image (built once, cached)."""
    if others_may_run(sys.executable):
        return Path(sys.executable)
    from cluster.rehearsal.cloud import build_image

    return build_image() / "bin" / "python"


def readable_code(base: Path) -> Path:
    """The project and the tests' user code where `nobody` may read them (pytest's tmp is 0700)."""
    code = base / "code"
    skip = shutil.ignore_patterns("__pycache__")
    for name in ("cluster", "service", "trainers", "configs"):
        shutil.copytree(REPO / name, code / name, ignore=skip)
    shutil.copytree(REPO / "tests" / "fixtures", code / "fixtures", ignore=skip)
    subprocess.run(["chmod", "-R", "a+rX", str(base)], check=True)
    return code


class Service:
    """The service as an operator deploys it on its own node: `ray start --head --port=...` with
    token auth, then `etrain serve` on that Ray, with its state folder and a secret in its
    environment. Restarting the service restarts `etrain serve`; its Ray stays up. With ``ray_of``,
    another `etrain serve` on that service's Ray (a Ray start is ~10 CPU-s of a busy machine)."""

    def __init__(self, work: Path, args: list[str], s3_url: str, ray_of: "Service | None" = None):
        self.work, self.args, self.port = work, args, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc, self.owns_ray = None, ray_of is None
        if ray_of is not None:
            self.gcs, self.tmp, self.env, self.ray, self.ray_log = ray_of.gcs, ray_of.tmp, ray_of.env, ray_of.ray, ray_of.ray_log
            return
        self.gcs = str(free_port())
        self.ray_log = work / f"service-ray-{self.port}.log"
        self.tmp = Path(tempfile.mkdtemp(prefix="etrs-", dir="/tmp"))  # its Ray's files; short socket paths
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), "TMPDIR": str(self.tmp),
                         "ETRAIN_SERVICE_PASSWORD": MARKER, "AWS_ENDPOINT_URL": s3_url,
                         "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "fixtures")])})
        self.ray = subprocess.Popen(
            [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--port={self.gcs}",
             "--node-ip-address=127.0.0.1", "--num-cpus=2", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
             f"--dashboard-agent-grpc-port={free_port()}", f"--metrics-export-port={free_port()}",
             f"--runtime-env-agent-port={free_port()}", f"--ray-client-server-port={free_port()}",
             f"--temp-dir={self.tmp}"],
            env=self.env, stdout=open(self.ray_log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.env["RAY_ADDRESS"] = f"127.0.0.1:{self.gcs}"

    def wait_ray(self) -> None:
        """Until `ray start` says its node is up: a GCS port that listens is not yet a node a
        driver can join, and on a busy machine `etrain serve` would give up on it."""
        log = self.ray_log
        wait_for(lambda: "Ray runtime started" in log.read_text() or (self.ray.poll() is not None and pytest.fail(
            f"the service's Ray exited: {log.read_text()[-3000:]}")), 120, "the service's Ray", poll_s=1)

    def run(self, *extra: str, wait: bool = True) -> subprocess.Popen:
        log = open(self.work / f"serve-{self.port}.log", "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1",
                                      "--port", str(self.port), *self.args, *extra],
                                     env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            wait_for(lambda: self._up() or (self.proc.poll() is not None and pytest.fail(
                f"etrain serve exited: {self.log()[-3000:]}")), 240, "the service", poll_s=1)
        return self.proc

    def _up(self) -> bool:
        try:
            return requests.get(f"{self.url}/healthz", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def log(self) -> str:
        return (self.work / f"serve-{self.port}.log").read_text()

    def stop_serve(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # `etrain serve` shuts Serve down, not the Ray it joined
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        if self.proc is not None:
            left = stop_session(self.proc.pid)
            self.proc.wait(timeout=30)
            assert not left, f"processes of etrain serve still run: {left}"

    def stop(self) -> None:
        self.stop_serve()
        if not self.owns_ray:
            return
        left = stop_session(self.ray.pid)
        self.ray.wait(timeout=30)
        assert not left, f"processes of the service's Ray still run: {left}"


@pytest.fixture(scope="module")
def split(s3_server, tmp_path_factory):
    import boto3
    import ray

    if os.geteuid() != 0:
        pytest.fail("this test starts a Ray as another Unix user, which needs root (CI runs as root)")
    if ray.is_initialized():
        ray.shutdown()  # the shared local Ray holds Ray's default agent ports; the next module starts it again
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=BUCKET)
    work = tmp_path_factory.mktemp("code-tenant")  # 0700 under pytest's root-only folder
    base = Path(tempfile.mkdtemp(prefix="etrj-", dir="/var/tmp"))
    base.chmod(0o755)
    temp = Path(tempfile.mkdtemp(prefix="etrj-", dir="/tmp"))  # short: Ray's socket paths must fit
    home = base / "home"
    home.mkdir()
    for path in (temp, home):
        os.chown(path, NOBODY, NOBODY)
    code, python = readable_code(base), jobs_python()
    jobs_token = secrets.token_hex(16)
    (work / "jobs_token").write_text(jobs_token)
    gcs_port, dash_port = free_port(), free_port()
    env = {"HOME": str(home), "PATH": f"{python.parent}:/usr/bin:/bin", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": jobs_token, "AWS_ENDPOINT_URL": s3_server, "AWS_REGION": "us-east-1",
           "AWS_DEFAULT_REGION": "us-east-1", "RAY_USAGE_STATS_ENABLED": "0", "LANG": "C.UTF-8"}
    jobs = subprocess.Popen(
        as_nobody(str(python.parent / "ray"), "start", "--head", "--block", f"--port={gcs_port}",
                  "--node-ip-address=127.0.0.1", "--num-cpus=2", "--dashboard-host=127.0.0.1",
                  f"--dashboard-port={dash_port}", f"--dashboard-agent-listen-port={free_port()}",
                  f"--dashboard-agent-grpc-port={free_port()}", f"--metrics-export-port={free_port()}",
                  f"--runtime-env-agent-port={free_port()}", f"--ray-client-server-port={free_port()}",
                  f"--temp-dir={temp}"),
        env=env, cwd=str(home), stdout=open(work / "jobs-ray.log", "w"), stderr=subprocess.STDOUT,
        start_new_session=True)
    services: list[Service] = []
    try:
        jobs_url = f"http://127.0.0.1:{dash_port}"
        wait_for(lambda: _answers(jobs_url, {"Authorization": f"Bearer {jobs_token}"}) or (
            jobs.poll() is not None and pytest.fail(f"the jobs cluster exited: {(work / 'jobs-ray.log').read_text()[-3000:]}")),
            180, "the jobs cluster's Jobs API", poll_s=1)
        tenant_env = {t: {"AWS_ACCESS_KEY_ID": f"{t}-own-key", "AWS_SECRET_ACCESS_KEY": f"{t}-own-secret",
                          "PYTHONPATH": f"{code}:{code / 'fixtures'}"} for t, _ in TOKENS.values()}
        (work / "config.yaml").write_text(yaml.safe_dump({
            "jobs_token_file": str(work / "jobs_token"), "python": str(python), "reconcile_interval_s": 1,
            "tenant_env": tenant_env}))
        from service.auth import hash_token

        (work / "tokens.yaml").write_text(yaml.safe_dump([{"tenant": t, "role": r, "sha256": hash_token(token_of(w))}
                                                          for w, (t, r) in TOKENS.items()]))
        args = ["--storage-root", f"s3://{BUCKET}/root", "--state-dir", str(work / "state"),
                "--tokens", str(work / "tokens.yaml"), "--config", str(work / "config.yaml")]

        def service(*extra: str, wait: bool = True, share_ray: bool = False) -> Service:
            """``share_ray``: on the Ray of a service started before, if there is one."""
            svc = Service(work, [*args, *extra], s3_server, ray_of=services[0] if share_ray and services else None)
            services.append(svc)
            svc.wait_ray()
            svc.run(wait=wait)
            return svc

        yield SimpleNamespace(work=work, jobs_url=jobs_url, service=service)
    finally:
        for svc in reversed(services):  # a Ray's owner last
            svc.stop()
            if svc.owns_ray:
                shutil.rmtree(svc.tmp, ignore_errors=True)
        left = stop_session(jobs.pid)
        jobs.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
        assert not left, f"processes of the jobs cluster still run: {left}"


def _answers(url: str, headers: dict) -> bool:
    try:
        return requests.get(f"{url}/api/jobs/", headers=headers, timeout=5).status_code == 200
    except requests.RequestException:
        return False


def api(svc, method: str, path: str, who: str, **kw) -> requests.Response:
    return requests.request(method, svc.url + path, headers={"Authorization": f"Bearer {token_of(who)}"},
                            timeout=60, **kw)


def wait_done(svc, job_id: str, who: str) -> dict:
    def done():
        r = api(svc, "GET", f"/v1/jobs/{job_id}", who).json()
        return r if r["state"] in ("SUCCEEDED", "FAILED", "STOPPED") else None

    return wait_for(done, 300, f"job {job_id} to finish", poll_s=1)


def test_a_code_tenants_job_reaches_nothing_of_the_service(split):
    svc = split.service("--dashboard-url", split.jobs_url)
    victim = api(svc, "POST", "/v1/jobs", "bob", json={
        "name": "victim", "training": {"batch_size": 32, "max_steps": 5, "log_interval_steps": 5},
        "distributed": {"num_workers": 1}, "model": {"hidden_size": 16}, "checkpoint": {"interval": 5}})
    assert victim.status_code == 201, victim.text
    attack = api(svc, "POST", "/v1/jobs", "mallory", json={
        "name": "attack", "distributed": {"num_workers": 1}, "train_loop": "attacker:tamper",
        "model": {"options": {"marker": MARKER, "join": True}}})
    assert attack.status_code == 201, attack.text
    vid, aid = victim.json()["id"], attack.json()["id"]
    finished = wait_done(svc, aid, "mallory")
    assert finished["state"] == "SUCCEEDED", (finished, api(svc, "GET", f"/v1/jobs/{aid}/logs", "mallory").text[-3000:])
    assert wait_done(svc, vid, "bob")["state"] == "SUCCEEDED"

    from cluster.storage import open_root

    report = open_root(f"s3://{BUCKET}/root").read_json("tenants", "crew-m", aid, "attack.json")
    assert report["uid"] == NOBODY, "the job ran as the jobs cluster's user"
    assert report["found"] == [] and report["changed"] == [], report["found"]  # no record, no token within reach
    assert any(str(split.work).startswith(d) for d in report["denied"]), "it looked where the state is, and was denied"
    assert report["environ_leaks"] == [] and report["environ_denied"] > 0, "the service's environment is not readable"
    assert not any(MARKER in v for v in report["env"].values())
    env = report["env"]  # the tenant's own keys, not the service's
    assert env["AWS_ACCESS_KEY_ID"] == "crew-m-own-key" and env["AWS_SECRET_ACCESS_KEY"] == "crew-m-own-secret"
    joined, service_port = report["joined"], svc.gcs
    assert service_port in joined and str(joined[service_port]).startswith("refused"), joined
    assert "AuthenticationError" in joined[service_port] or "InvalidAuthToken" in joined[service_port], joined
    assert NOBODY in joined.values(), "its own jobs cluster takes it (trusted within the jobs cluster)"
    assert 0 not in joined.values(), "no task ran as the service's user"

    svc.stop_serve()  # a restart reads the state back: unchanged
    svc.run()
    after = api(svc, "GET", f"/v1/jobs/{vid}", "root")
    assert after.status_code == 200 and after.json()["tenant"] == "team-b"
    assert api(svc, "GET", f"/v1/jobs/{vid}", "mallory").status_code == 404
    assert {j["tenant"] for j in api(svc, "GET", "/v1/jobs", "mallory").json()["items"]} == {"crew-m"}  # no admin


def test_a_graceful_stop_reaches_a_job_on_the_jobs_cluster_without_a_sigterm(split):
    """The service asks for the stop in the job's folder in storage, which the jobs cluster reads; the
    service's own Ray KV (where it asked before) is not the jobs cluster's. Ray's stop (SIGTERM) would
    come only after --stop-wait-s (300 s): the job must stop by itself, at a checkpoint, long before."""
    svc = split.service("--dashboard-url", split.jobs_url, "--stop-wait-s", "300")
    long = api(svc, "POST", "/v1/jobs", "mallory", json={
        "name": "long", "training": {"batch_size": 32, "max_steps": 100000, "log_interval_steps": 5},
        "distributed": {"num_workers": 1, "use_gpu": False}, "checkpoint": {"interval": 20},
        "model": {"factory": "slowpkg:busy_model", "options": {"compute_s": 0.05}},
        "data": {"factory": "userpkg:make_data"}})
    assert long.status_code == 201, long.text
    job_id = long.json()["id"]
    def training():
        record = api(svc, "GET", f"/v1/jobs/{job_id}", "mallory").json()
        assert record["state"] in ("PENDING", "RUNNING"), (record, api(svc, "GET", f"/v1/jobs/{job_id}/logs",
                                                                       "mallory").text[-3000:])
        return api(svc, "GET", f"/v1/jobs/{job_id}/metrics", "mallory").json()["rows"]
    wait_for(training, 240, "the job's first metrics (written at its checkpoints)")
    asked_at = time.monotonic()
    assert api(svc, "POST", f"/v1/jobs/{job_id}/stop", "mallory").status_code == 202
    done = wait_done(svc, job_id, "mallory")
    took_s = time.monotonic() - asked_at
    assert done["state"] == "STOPPED", (done, api(svc, "GET", f"/v1/jobs/{job_id}/logs", "mallory").text[-3000:])
    assert done["summary"]["status"] == "stopped" and done["summary"]["final_step"] < 100000, done["summary"]
    assert took_s < 120, f"the stop took {took_s:.0f} s: it did not reach the job, Ray's SIGTERM would have"
    svc.stop_serve()


def test_the_service_refuses_code_tenants_on_its_own_cluster(split):
    svc = split.service(wait=False, share_ray=True)  # no --dashboard-url: jobs would run on the service's own Ray
    assert svc.proc.wait(timeout=240) == 2, svc.log()[-3000:]
    assert "error: tenant(s) crew-m have role 'code'" in svc.log() and "is the service's own Ray" in svc.log()
    assert "jobs_token_file" in svc.log()
