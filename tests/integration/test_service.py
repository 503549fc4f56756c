"""The job service on a real Ray Serve (127.0.0.1) over a real local Ray running real jobs.

Each job costs a Ray Train start (seconds of CPU on a small machine), so tests share them:
alice's quick job (submitted over HTTP with an Idempotency-Key) and bob's job (submitted with
the CLI) serve every test that needs a job of theirs.
"""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from bearer import bearer_request
from conftest import free_port
from waiting import wait_for

pytestmark = pytest.mark.ray
REPO = Path(__file__).resolve().parents[2]
TOKENS = {"alice": ("team-a", "user"), "bob": ("team-b", "user"), "root": ("ops", "admin"), "fuzz": ("fuzz", "user"),
          "fuzz-ok": ("fuzz-ok", "user")}


def token_of(who: str) -> str:
    return f"tok-{who}-0123456789abcdef"


def deploy(settings, tokens: list[dict]) -> None:
    from ray import serve

    from service.deployment import JobService

    serve.run(JobService.bind(settings.model_dump(), tokens), name="etrain", route_prefix="/")


@pytest.fixture(scope="module")
def service(ray_local, tmp_path_factory):
    from ray import serve
    from ray._private.worker import get_dashboard_url

    from service.auth import TokenEntry
    from service.settings import ServiceSettings

    root = tmp_path_factory.mktemp("service-root")
    settings = ServiceSettings(storage_root=str(root), state_dir=str(tmp_path_factory.mktemp("service-state")),
                               ray_dashboard_url=f"http://{get_dashboard_url()}", tenant_quotas={"fuzz": 0, "fuzz-ok": 2},
                               stop_wait_s=60, reconcile_interval_s=1, max_body_bytes=65536,
                               allowed_factories=["slowpkg:busy_model", "userpkg:make_data"])
    tokens = [TokenEntry(tenant=t, role=r, token=token_of(w)).model_dump(exclude={"token"})
              for w, (t, r) in TOKENS.items()]
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deploy(settings, tokens)
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}", root=root, settings=settings, tokens=tokens)
    serve.delete("etrain")
    serve.shutdown()


def api(svc, method: str, path: str, who: str | None = "alice", **kw) -> requests.Response:
    return bearer_request(svc.url, who and token_of(who), method, path, **kw)


# A model (on the blobs) that waits 20 ms a step (a step's compute, without the CPU): a job that
# runs until the test stops it leaves the machine to the rest of the suite meanwhile.
WAITING = {"model": {"factory": "slowpkg:busy_model", "options": {"compute_s": 0.02}},
           "data": {"factory": "userpkg:make_data"}}


def job_spec(name: str, max_steps: int, workers: int = 1, interval: int = 20, waiting: bool = False) -> dict:
    return {"name": name, "training": {"batch_size": 64, "learning_rate": 0.01, "max_steps": max_steps,
                                       "log_interval_steps": 10},
            "distributed": {"num_workers": workers}, "model": {"hidden_size": 32},
            "checkpoint": {"interval": interval}, **(WAITING if waiting else {})}


def wait_state(svc, job_id: str, states: set[str], timeout_s: float = 240, who: str = "alice") -> dict:
    def done():
        r = api(svc, "GET", f"/v1/jobs/{job_id}", who).json()
        return r if r["state"] in states else None
    return wait_for(done, timeout_s, f"job {job_id} to reach {states}", poll_s=0.5)


QUICK_KEY = "q1"


@pytest.fixture(scope="module")
def quick(service):
    """Alice's 30-step job, submitted with an Idempotency-Key; the answer to that first submit."""
    submitted = api(service, "POST", "/v1/jobs", json=job_spec("quick", 30), headers={"Idempotency-Key": QUICK_KEY})
    yield submitted
    if submitted.status_code == 201:  # nothing left running after the module, whichever tests ran
        wait_state(service, submitted.json()["id"], {"SUCCEEDED", "FAILED"})


def test_submit_run_stop_resume_over_http(service, quick):
    long_ = api(service, "POST", "/v1/jobs", data=json.dumps(job_spec("long", 200000, workers=2, waiting=True)).encode(),
                headers={"Content-Type": "application/yaml"})  # YAML is a superset of JSON
    assert quick.status_code == 201 and long_.status_code == 201, (quick.text, long_.text)
    quick_id, long_id = quick.json()["id"], long_.json()["id"]
    assert quick.json()["name"] == "quick" and quick.json()["submissions"] == [f"etrain-{quick_id}-0"]

    done = wait_state(service, quick_id, {"SUCCEEDED", "FAILED"})
    assert done["state"] == "SUCCEEDED", api(service, "GET", f"/v1/jobs/{quick_id}/logs").text[-3000:]
    assert done["summary"]["final_step"] == 30
    assert done["progress"]["step"] == done["progress"]["target_step"] == 30 and done["progress"]["fraction"] == 1.0
    checkpoints = api(service, "GET", f"/v1/jobs/{quick_id}/checkpoints").json()
    assert checkpoints[-1]["step"] == 30 and checkpoints[-1]["complete"] and checkpoints[-1]["size_bytes"] > 0
    rows = api(service, "GET", f"/v1/jobs/{quick_id}/metrics").json()["rows"]
    assert [r["step"] for r in rows] == [10, 20, 30] and all(r["loss"] > 0 for r in rows)
    assert "[etrain] step 30/30" in api(service, "GET", f"/v1/jobs/{quick_id}/logs", params={"tail": 50}).text

    # The long job: stop takes a final checkpoint; resume continues from it.
    wait_for(lambda: api(service, "GET", f"/v1/jobs/{long_id}/metrics").json()["rows"], 240, "long job's first rows")
    stopping = api(service, "POST", f"/v1/jobs/{long_id}/stop")
    assert stopping.status_code == 202 and stopping.json()["state"] == "STOPPING"
    stopped = wait_state(service, long_id, {"STOPPED", "FAILED"}, 180)
    assert stopped["state"] == "STOPPED", stopped
    at = stopped["summary"]["final_step"]
    assert 0 < at < 200000 and api(service, "GET", f"/v1/jobs/{long_id}/checkpoints").json()[-1]["step"] == at
    assert api(service, "POST", f"/v1/jobs/{long_id}/stop").status_code == 409  # already stopped: says so

    resumed = api(service, "POST", f"/v1/jobs/{long_id}/resume")
    assert resumed.status_code == 202 and resumed.json()["submissions"][-1] == f"etrain-{long_id}-1"
    wait_for(lambda: f"resumed from step {at}" in api(service, "GET", f"/v1/jobs/{long_id}/logs").text, 240,
             "the resumed attempt to load the stop's checkpoint")
    wait_for(lambda: api(service, "GET", f"/v1/jobs/{long_id}/metrics").json()["rows"][-1]["step"] > at, 120,
             "steps after the resume")
    api(service, "POST", f"/v1/jobs/{long_id}/stop")
    assert wait_state(service, long_id, {"STOPPED", "FAILED"}, 180)["state"] == "STOPPED"


@pytest.mark.parametrize("body,content_type,expected", [
    ({"training": {"batch_size": -1}}, "application/json", "training.batch_size: -1"),
    ({"trainng": {}}, "application/json", "trainng: unknown key"),
    ("training: [1, 2", "application/yaml", "fix the YAML syntax"),
    ("[1, 2]", "application/json", "top level is list"),
    ({"sweep": {"space": {}}}, "application/json", "POST it to /v1/sweeps"),
])
def test_invalid_specs_get_422_with_field_paths_and_nothing_is_stored(service, body, content_type, expected):
    before = api(service, "GET", "/v1/jobs", "root").json()["total"]
    specs_before = sorted((service.root / "checked-specs").glob("*/*.json"))
    data = body if isinstance(body, str) else json.dumps(body)
    r = api(service, "POST", "/v1/jobs", data=data.encode(), headers={"Content-Type": content_type})
    assert r.status_code == 422, r.text
    assert any(expected in p for p in r.json()["problems"]), r.json()
    assert api(service, "GET", "/v1/jobs", "root").json()["total"] == before
    assert sorted((service.root / "checked-specs").glob("*/*.json")) == specs_before  # no spec written


def test_invalid_sweep_space_names_the_path(service):
    body = {"training": {"max_steps": 5}, "sweep": {"space": {"training.batch_size": {"choice": []}}}}
    r = api(service, "POST", "/v1/sweeps", json=body)
    assert r.status_code == 422 and "sweep.space.training.batch_size.choice: []: empty" in r.text


def test_limits_body_size_quota_and_idempotency(service, quick):
    big = {"name": "big", "data": {"options": {"pad": "x" * 70000}}}
    assert api(service, "POST", "/v1/jobs", json=big).status_code == 413
    r = api(service, "POST", "/v1/jobs", "fuzz", json=job_spec("q", 5))
    assert r.status_code == 429 and "quota of 0 slots" in r.json()["detail"]
    # The quick job's submit, sent again with its key: the same job, not a second one.
    again = api(service, "POST", "/v1/jobs", json=job_spec("quick", 30), headers={"Idempotency-Key": QUICK_KEY})
    assert (quick.status_code, again.status_code) == (201, 200) and quick.json()["id"] == again.json()["id"]
    other = api(service, "POST", "/v1/jobs", json=job_spec("other", 5), headers={"Idempotency-Key": QUICK_KEY})
    assert other.status_code == 409 and "different body" in other.json()["detail"]


def etrain(service, *args: str, who: str | None = "alice"):
    import subprocess
    import sys

    env_args = ["--server", service.url] + (["--token", token_of(who)] if who else [])
    cmd = [sys.executable, "-m", "service.cli", *args[:2], *env_args, *args[2:]] if args[0] in ("jobs", "sweeps") \
        else [sys.executable, "-m", "service.cli", args[0], *env_args, *args[1:]]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)


@pytest.fixture(scope="module")
def bobs_cli_job(service, tmp_path_factory):
    """Bob's job, submitted with the CLI (`etrain submit --json`): the CLI test's and the tenants test's."""
    spec = tmp_path_factory.mktemp("cli") / "cli-job.yaml"
    spec.write_text("training: {batch_size: 64, max_steps: 5}\ndistributed: {num_workers: 1}\n")
    out = etrain(service, "submit", str(spec), "--json", who="bob")
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    yield SimpleNamespace(out=out, record=record)
    wait_state(service, record["id"], {"SUCCEEDED", "FAILED"}, who="bob")  # nothing left running after the module


def test_tenants_see_only_their_own(service, quick, bobs_cli_job):
    a, b = quick.json()["id"], bobs_cli_job.record["id"]
    assert api(service, "GET", "/v1/jobs", None).status_code == 401
    assert api(service, "GET", f"/v1/jobs/{a}", None).status_code == 401
    wrong = requests.get(service.url + "/v1/jobs", headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401 and wrong.headers["WWW-Authenticate"] == "Bearer"
    assert requests.get(service.url + "/healthz", timeout=30).json() == {"status": "ok"}  # the one open route
    for method, path in (("GET", ""), ("GET", "/logs"), ("GET", "/metrics"), ("GET", "/checkpoints"),
                         ("POST", "/stop"), ("POST", "/resume")):
        r = api(service, method, f"/v1/jobs/{a}{path}", "bob")
        assert r.status_code == 404 and a in r.json()["detail"], (path, r.text)
    assert a not in {j["id"] for j in api(service, "GET", "/v1/jobs", "bob").json()["items"]}
    assert b in {j["id"] for j in api(service, "GET", "/v1/jobs", "bob").json()["items"]}
    everyone = {j["id"] for j in api(service, "GET", "/v1/jobs", "root").json()["items"]}
    assert {a, b} <= everyone
    assert api(service, "GET", f"/v1/jobs/{a}", "root").json()["tenant"] == "team-a"
    wait_state(service, b, {"SUCCEEDED", "FAILED"}, who="bob")


def test_a_sweep_over_http_runs_its_trials_and_reports_the_best(service):
    body = {**job_spec("http-sweep", 20), "sweep": {
        "search": "grid", "scheduler": "fifo", "max_concurrent_trials": 2,
        "space": {"training.learning_rate": {"grid": [0.003, 0.03]}}}}
    r = api(service, "POST", "/v1/sweeps", json=body)
    assert r.status_code == 201, r.text
    sweep_id = r.json()["id"]
    assert r.json()["kind"] == "sweep" and sweep_id.startswith("s-")
    assert api(service, "GET", f"/v1/jobs/{sweep_id}").status_code == 404  # a sweep is not a job

    def finished():
        got = api(service, "GET", f"/v1/sweeps/{sweep_id}").json()
        return got if got["state"] in ("SUCCEEDED", "FAILED") else None
    done = wait_for(finished, 300, "the sweep to finish", poll_s=1)
    assert done["state"] == "SUCCEEDED", api(service, "GET", f"/v1/sweeps/{sweep_id}/logs").text[-3000:]
    results = done["summary"]
    assert len(results["trials"]) == 2 and results["best"]["params"]["training.learning_rate"] in (0.003, 0.03)
    checkpoints = api(service, "GET", f"/v1/sweeps/{sweep_id}/checkpoints").json()
    assert {c["trial"] for c in checkpoints} == {f"trial-{t['trial']}" for t in results["trials"]}
    assert sweep_id in {s["id"] for s in api(service, "GET", "/v1/sweeps").json()["items"]}


def test_the_cli_client_submits_lists_and_explains_errors(service, bobs_cli_job, tmp_path):
    out, record = bobs_cli_job.out, bobs_cli_job.record
    assert record["name"] == "cli-job" and record["state"] in ("RUNNING", "PENDING"), out.stdout
    listed = etrain(service, "jobs", "list", who="bob")
    assert listed.returncode == 0 and record["id"] in listed.stdout and "STATE" in listed.stdout
    assert max(len(line) for line in listed.stdout.splitlines()) <= 80
    shown = etrain(service, "jobs", "get", record["id"], who="bob")
    assert f"id:         {record['id']}" in shown.stdout and "progress:" in shown.stdout
    got = etrain(service, "jobs", "get", record["id"], "--json", who="bob")
    assert json.loads(got.stdout)["id"] == record["id"]

    bad = tmp_path / "bad.yaml"
    bad.write_text("training: {batch_size: 0}\n")
    refused = etrain(service, "submit", str(bad))
    assert refused.returncode == 2 and "error 422" in refused.stderr and "training.batch_size: 0" in refused.stderr
    anonymous = etrain(service, "jobs", "list", who=None)
    assert anonymous.returncode == 1 and "error 401" in anonymous.stderr and "Bearer" in anonymous.stderr
    missing = etrain(service, "jobs", "get", "j-000000000000")
    assert missing.returncode == 1 and "no job 'j-000000000000'" in missing.stderr
    wait_state(service, record["id"], {"SUCCEEDED", "FAILED"}, who="bob")


# ---------------------------------------------------------------- replica and service restarts


def with_retries(call, what: str, timeout_s: float = 120):
    """What a careful client does: retry connection errors and 5xx (a replica being replaced)."""
    def attempt():
        try:
            r = call()
        except requests.RequestException:
            return None
        return r if r.status_code < 500 else None
    return wait_for(attempt, timeout_s, what, poll_s=0.2)


# Two clients each submit, then the replica is killed: their retried submits (same key) and polls
# meet it being replaced, and each client still gets its one job back; each of the jobs runs.
CLIENTS = 2


def test_killing_the_replica_loses_or_doubles_no_submission_and_a_restart_keeps_every_record(service, ray_local):
    from ray._private.worker import get_dashboard_url
    from ray.util.state import list_actors

    results: dict[int, list[str]] = {}
    submitted = threading.Barrier(CLIENTS + 1)  # every client's first submit is in, then the kill
    killed = threading.Event()

    def client(i: int) -> None:
        key, body = f"kill-{uuid.uuid4().hex}", job_spec(f"kill-{i}", 5)
        ids = []
        for attempt in range(3):  # the same submit, retried as a client would after a timeout: one job
            r = with_retries(lambda: api(service, "POST", "/v1/jobs", json=body, headers={"Idempotency-Key": key}),
                             f"client {i}'s submit")
            assert r.status_code in (200, 201), r.text
            ids.append(r.json()["id"])
            if attempt == 0:
                submitted.wait(120)
                killed.wait(120)
            for _ in range(5):
                with_retries(lambda: api(service, "GET", f"/v1/jobs/{ids[-1]}"), f"client {i}'s poll")
        results[i] = ids

    # This Ray's own state API: with other Rays on the machine, list_actors() cannot pick one by itself.
    def replicas() -> list:
        return [a for a in list_actors(address=f"http://{get_dashboard_url()}", filters=[("state", "=", "ALIVE")])
                if a.class_name.startswith("ServeReplica:etrain:JobService")]

    found = wait_for(replicas, 30, "the replica")[0]
    replica = ray_local.get_actor(found.name, namespace=found.ray_namespace)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    submitted.wait(120)
    ray_local.kill(replica, no_restart=True)  # their retried submits and polls meet a replica being replaced
    killed.set()
    for t in threads:
        t.join(300)
    assert sorted(results) == list(range(CLIENTS))
    # Serve retries a request whose replica died on the replica that replaces it: the clients see
    # no error, so the kill is proven by the replica that served them after it.
    assert found.actor_id not in {a.actor_id for a in replicas()}, "the killed replica still serves"
    for i, ids in results.items():
        assert len(set(ids)) == 1, f"client {i} got {ids}: a retried submit made a second job"
    everyone = with_retries(lambda: api(service, "GET", "/v1/jobs", "root", params={"limit": 500}), "list").json()
    mine = [j for j in everyone["items"] if j["name"].startswith("kill-")]
    assert sorted(j["name"] for j in mine) == [f"kill-{i}" for i in range(CLIENTS)]  # none lost, none doubled
    for j in mine:
        done = wait_state(service, j["id"], {"SUCCEEDED", "FAILED"})
        assert done["state"] == "SUCCEEDED" and done["summary"]["final_step"] == 5, done

    # Restart the whole service: the same records come back from storage.
    before = {j["id"]: j["state"] for j in api(service, "GET", "/v1/jobs", "root", params={"limit": 500}).json()["items"]}
    from ray import serve

    serve.delete("etrain")
    deploy(service.settings, service.tokens)
    after = with_retries(lambda: api(service, "GET", "/v1/jobs", "root", params={"limit": 500}), "list after restart")
    assert {j["id"]: j["state"] for j in after.json()["items"]} == before


# ---------------------------------------------------------------- fuzzing the OpenAPI schema


@pytest.mark.parametrize("tenant", ["fuzz", "fuzz-ok"])
def test_fuzzing_the_openapi_schema_finds_no_5xx_and_no_schema_violation(service, tenant):
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                                   status_code_conformance)

    # No 5xx, every status and body as the schema says. (Schemathesis' "positive data accepted" is
    # left out on purpose: a body can fit the JSON schema of "a mapping" and still be a bad job spec.)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    schema = schemathesis.openapi.from_url(service.url + "/openapi.json")
    # "fuzz" has quota 0: a valid spec gets a 429. "fuzz-ok" has room for two: a generated spec that
    # happens to be valid is stored and submitted, and what follows (get, stop, resume) runs on it.
    headers = {"Authorization": f"Bearer {token_of(tenant)}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 17  # 8 routes each for jobs and sweeps, and /healthz

    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case):
            case.call_and_validate(headers=headers, checks=checks)
        fuzz()
    for plural in ("jobs", "sweeps"):  # leave nothing running
        for record in api(service, "GET", f"/v1/{plural}", tenant, params={"limit": 500}).json()["items"]:
            if record["state"] in ("PENDING", "RUNNING"):
                api(service, "POST", f"/v1/{plural}/{record['id']}/stop", tenant)
