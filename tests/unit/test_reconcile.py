"""The reconciler under Ray's Jobs API faults: 5xx, 404, refused connections, a stop that fails.

One test runs Ray's real JobSubmissionClient against a tiny HTTP server that answers like a
dashboard under trouble, so the meaning of its errors is checked against the client itself;
the others use a fake client at the edge to drive the decisions.
"""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from service.jobs import JobManager, RayUnavailable, reconcile_decision
from service.settings import ServiceSettings
from service.states import RayStatus
from service.store import Record


class FakeDashboard:
    """Answers /api/version; /api/jobs/<id> with ``status_code``; records every POST and answers
    it with the next of ``post_answers`` ((code, text) pairs), then 200."""

    def __init__(self):
        self.status_code, self.posts, self.post_answers = 503, [], []
        dash = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/api/version":
                    return self._send(200, {"version": "4", "ray_version": "2.60.0", "ray_commit": "x"})
                if self.path.rstrip("/") == "/api/jobs":
                    return self._send(200, [])
                self._send(dash.status_code, {"error": "SlowDown" if dash.status_code == 503 else "no such job"})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                dash.posts.append(json.loads(self.rfile.read(length) or b"{}"))
                if dash.post_answers:
                    code, text = dash.post_answers.pop(0)
                    data = text.encode()
                    self.send_response(code)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    return self.wfile.write(data)
                self._send(200, {"job_id": "raysubmit", "submission_id": dash.posts[-1].get("submission_id")})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def manager(tmp_path, client, **settings) -> JobManager:
    return JobManager(ServiceSettings(storage_root=str(tmp_path), state_dir=str(tmp_path.parent / f"{tmp_path.name}-state"),
                                      ray_dashboard_url="http://127.0.0.1:1",
                                      **{"reconcile_interval_s": 0.05, **settings}), client)


def running_record(mgr: JobManager, state: str = "RUNNING") -> Record:
    now = time.time()
    record = Record(id="j-abc", kind="job", tenant="a", name="n", spec={"name": "j-abc"}, spec_uri="/x/spec.json",
                    storage="/x", created_at=now, updated_at=now, submissions=["etrain-j-abc-0"])
    record.move(state, "test")
    mgr.store.save(record)
    return record


def test_a_503_from_the_jobs_api_never_resubmits_and_a_404_does(tmp_path, monkeypatch):
    from ray.job_submission import JobSubmissionClient

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    dash = FakeDashboard()
    try:
        mgr = manager(tmp_path, JobSubmissionClient(dash.url))
        running_record(mgr)
        for _ in range(3):
            mgr.reconcile_one("j-abc")
        record = mgr.store.get("j-abc")
        assert dash.posts == [], "a 503 is no news about the job: a second driver must not start"
        assert record.state == "RUNNING" and record.submissions == ["etrain-j-abc-0"]
        assert "did not answer" in record.error and "503" in record.error
        dash.status_code = 404  # now Ray really does not know the submission (its head restarted)
        record = mgr.reconcile_one("j-abc")
        assert [p["submission_id"] for p in dash.posts] == ["etrain-j-abc-1"]
        assert record.state == "RUNNING" and record.error is None
    finally:
        dash.close()


def test_a_head_with_no_job_agent_yet_gets_the_same_submission_again_and_a_refusal_fails(tmp_path, monkeypatch):
    """Ray's real client against a dashboard whose job agent has not registered (a fresh head,
    a busy machine): the record waits PENDING under back-off and the same id is sent again."""
    from ray.job_submission import JobSubmissionClient

    from service.auth import Principal

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    dash = FakeDashboard()
    try:
        mgr = manager(tmp_path, JobSubmissionClient(dash.url))
        no_agent = (500, "No available agent to submit job, please try again later.")
        dash.post_answers = [no_agent, no_agent]
        dash.status_code = 404  # Ray never took it
        record, created = mgr.create("job", Principal("team-a", "user"), {"name": "agentless"}, None, "")
        assert created and record.state == "PENDING", record
        assert "did not take submission etrain-" in record.error and "try again later" in record.error
        assert "next try in" in record.error
        for _ in range(100):
            record = mgr.reconcile_one(record.id) if time.monotonic() > mgr._failures.get(record.id, (0, 0))[1] \
                else mgr.store.get(record.id)
            if record.state == "RUNNING":
                break
            time.sleep(0.01)
        assert record.state == "RUNNING" and record.error is None, record
        sids = [p["submission_id"] for p in dash.posts]
        assert sids == [record.submissions[0]] * 3 and len(record.submissions) == 1, "one attempt, sent three times"

        dash.post_answers = [(400, "runtime_env: bad field")]
        refused, _ = mgr.create("job", Principal("team-a", "user"), {"name": "refused"}, None, "")
        assert refused.state == "FAILED" and "Ray refused the submission" in refused.error
        assert "bad field" in refused.error
    finally:
        dash.close()


def test_the_jobs_client_talks_to_the_dashboard_it_is_given_whatever_ray_address_says(tmp_path, monkeypatch):
    """The service joins its own Ray by RAY_ADDRESS; Ray's client would take that over the jobs
    cluster's URL and send every job to the service's own cluster."""
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    dash = FakeDashboard()
    try:
        monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # the service's own cluster
        monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://127.0.0.1:1")
        mgr = JobManager(ServiceSettings(storage_root=str(tmp_path / "root"), state_dir=str(tmp_path / "state"),
                                         ray_dashboard_url=dash.url))
        mgr.client.submit_job(entrypoint="true", submission_id="etrain-x-0")
        assert [p["submission_id"] for p in dash.posts] == ["etrain-x-0"]
        assert os.environ["RAY_ADDRESS"] == "127.0.0.1:1", "the process's own setting is left as it was"
    finally:
        dash.close()


@pytest.mark.parametrize("exc,retryable", [
    (RuntimeError("Request failed with status code 500: No available agent to submit job, please try again later."),
     True),
    (RuntimeError("Request failed with status code 503: Service Unavailable"), True),
    (RuntimeError("Request failed with status code 502: Bad Gateway"), True),
    (ConnectionError("connection refused"), True),
    (RuntimeError("Request failed with status code 500: Traceback ... ValueError"), False),
    (RuntimeError("Request failed with status code 400: bad runtime_env"), False),
    (ValueError("not a Ray answer"), False),
])
def test_which_submission_errors_are_sent_again(exc, retryable):
    from service.jobs import submission_retryable

    assert submission_retryable(exc) is retryable


class FakeClient:
    """Ray's JobSubmissionClient at the edge: statuses by submission, errors queued per method."""

    def __init__(self, status: str = "RUNNING"):
        from ray.job_submission import JobStatus

        self.JobStatus = JobStatus
        self.status = {"etrain-j-abc-0": status}
        self.errors: dict[str, list[BaseException]] = {}
        self.calls: list[str] = []
        self.alive: list[str] = []

    def _maybe_fail(self, method: str) -> None:
        self.calls.append(method)
        if self.errors.get(method):
            raise self.errors[method].pop(0)

    def get_job_status(self, sid):
        self._maybe_fail("get_job_status")
        if sid not in self.status:
            raise RuntimeError(f"Request failed with status code 404: Job {sid} does not exist.")
        return self.JobStatus(self.status[sid])

    def stop_job(self, sid):
        self._maybe_fail("stop_job")
        self.status[sid] = "STOPPED"
        return True

    def submit_job(self, **kwargs):
        self._maybe_fail("submit_job")
        self.status[kwargs["submission_id"]] = "RUNNING"
        return kwargs["submission_id"]

    def list_jobs(self):
        from types import SimpleNamespace

        self._maybe_fail("list_jobs")
        return [SimpleNamespace(submission_id=s, status=self.JobStatus("RUNNING")) for s in self.alive]

    def get_job_logs(self, sid):
        self._maybe_fail("get_job_logs")
        return "line\n"


def test_a_reconciler_that_meets_a_connection_error_at_start_keeps_running(tmp_path):
    from service import app
    from service.auth import Tokens

    client = FakeClient()
    client.errors["get_job_status"] = [ConnectionError("Failed to connect to Ray at address: http://127.0.0.1:8265.")]
    settings = ServiceSettings(storage_root=str(tmp_path), state_dir=str(tmp_path.parent / f"{tmp_path.name}-state"),
                               ray_dashboard_url="http://127.0.0.1:1",
                               reconcile_interval_s=0.05)
    running_record(JobManager(settings, client))
    stop = app.configure(settings, Tokens([]), client=client)
    try:
        deadline = time.time() + 30
        while client.calls.count("get_job_status") < 3 and time.time() < deadline:
            time.sleep(0.05)
        assert client.calls.count("get_job_status") >= 3, "the reconciler thread died at its first error"
        assert app.manager().store.get("j-abc").state == "RUNNING"
    finally:
        stop.set()


def test_a_failed_ray_stop_is_retried_until_the_record_leaves_stopping(tmp_path, monkeypatch):
    client = FakeClient()
    client.errors["stop_job"] = [RuntimeError("Request failed with status code 503: busy."),
                                 ConnectionError("refused")]
    mgr = manager(tmp_path, client, stop_wait_s=0.01)
    record = running_record(mgr)
    mgr.stop(record)
    deadline = time.time() + 30
    while mgr.store.get("j-abc").state == "STOPPING" and time.time() < deadline:
        mgr.reconcile_all()
        time.sleep(0.05)
    record = mgr.store.get("j-abc")
    assert client.calls.count("stop_job") == 3
    assert record.state == "STOPPED", record.history


def test_an_error_while_stopping_is_on_the_record_and_backs_off(tmp_path):
    client = FakeClient()
    client.errors["stop_job"] = [RuntimeError("Request failed with status code 503: busy.")] * 3
    mgr = manager(tmp_path, client, stop_wait_s=0.01, reconcile_interval_s=30)
    record = running_record(mgr, "STOPPING")
    time.sleep(0.05)  # past the grace period
    record = mgr.reconcile_one(record.id)
    assert record.state == "STOPPING" and "Ray did not stop etrain-j-abc-0" in record.error
    assert "next try in 30s" in record.error
    mgr.reconcile_all()  # inside the back-off: Ray is left alone
    assert client.calls.count("stop_job") == 1


def test_logs_say_why_they_are_missing(tmp_path):
    client = FakeClient()
    mgr = manager(tmp_path, client)
    record = running_record(mgr)
    assert mgr.logs(record, 10) == "line\n"
    client.errors["get_job_logs"] = [RuntimeError("Request failed with status code 500: boom.")]
    with pytest.raises(RayUnavailable, match="did not return the logs of etrain-j-abc-0") as info:
        mgr.logs(record, 10)
    assert not info.value.missing
    client.errors["get_job_logs"] = [RuntimeError("Request failed with status code 404: Job x does not exist.")]
    with pytest.raises(RayUnavailable, match="no longer has the logs") as info:
        mgr.logs(record, 10)
    assert info.value.missing


def test_a_missing_latest_submission_is_not_resubmitted_while_an_earlier_one_runs(tmp_path):
    client = FakeClient()
    mgr = manager(tmp_path, client)
    record = running_record(mgr)
    record.submissions.append("etrain-j-abc-1")  # saved, then the replica died before Ray heard of it
    mgr.store.save(record)
    client.alive = ["etrain-j-abc-0"]
    assert mgr.reconcile_one(record.id).submissions == ["etrain-j-abc-0", "etrain-j-abc-1"]
    assert "submit_job" not in client.calls
    client.alive = []
    assert mgr.reconcile_one(record.id).submissions[-1] == "etrain-j-abc-2"


@pytest.mark.parametrize("state,ray_status,others_alive,overdue,expected", [
    ("RUNNING", RayStatus.MISSING, True, False, ("RUNNING", None)),
    ("RUNNING", RayStatus.MISSING, False, False, ("RUNNING", "resubmit")),
    ("PENDING", RayStatus.MISSING, False, False, ("PENDING", "send")),
    ("PENDING", None, False, False, ("RUNNING", "resubmit")),
    ("PENDING", "RUNNING", False, False, ("RUNNING", None)),
    ("STOPPING", "RUNNING", False, True, ("STOPPING", "stop")),
    ("STOPPING", "RUNNING", False, False, ("STOPPING", None)),
    ("STOPPING", RayStatus.UNREACHABLE, False, True, ("STOPPING", "wait")),
])
def test_reconcile_decision_with_live_submissions_and_overdue_stops(state, ray_status, others_alive, overdue,
                                                                     expected):
    assert reconcile_decision(state, ray_status, None, others_alive, overdue) == expected


def test_an_absolute_checkpoint_path_over_http_stays_in_the_tenants_folder(tmp_path):
    from trainers.config import validate
    from trainers.home import job_home

    mgr = manager(tmp_path, FakeClient())
    from service.auth import Principal

    run = mgr.check_spec("job", {"checkpoint": {"path": "/srv/service/model_{step}.pt"}},
                         Principal("team-a", "user"), "j-1").run
    home = job_home(validate(run))
    assert home.uri == mgr.tenant_root("team-a").uri_of("j-1")
    assert home.run_path.startswith(mgr.tenant_root("team-a").path("j-1") + "/")


@pytest.mark.parametrize("kind", ["job", "sweep"])
def test_a_record_from_before_checked_specs_runs_the_services_own_copy(tmp_path, kind):
    """A record made when the checked spec lay in the tenant's own prefix, with no digest and (a sweep)
    no key for its Tune state: its next attempt runs the service's copy, stored apart with its digest,
    never the file its tenant could have rewritten, and a sweep gets a key (Tune's unsigned state is
    then refused on resume rather than unpickled)."""
    import hashlib
    import json

    from service.auth import Principal

    client = FakeClient()
    sent = []
    client.submit_job = lambda **kw: sent.append(kw)
    mgr = manager(tmp_path, client)
    rid = f"{kind[0]}-abc"
    spec = {"name": rid, "training": {"max_steps": 5}, **({"sweep": {"space": {"training.seed": {"choice": [1]}}}}
                                                         if kind == "sweep" else {})}
    old_file = tmp_path / "tenants" / "a" / "specs" / f"{rid}.json"
    old_file.parent.mkdir(parents=True)
    old_file.write_text(json.dumps({"name": rid, "model": {"factory": "subprocess:getoutput"}}))  # rewritten
    now = time.time()
    record = Record(id=rid, kind=kind, tenant="a", name="n", spec=spec, spec_uri=str(old_file), storage="/x",
                    created_at=now, updated_at=now, submissions=[f"etrain-{rid}-0"])
    record.move("STOPPED", "test")
    mgr.store.save(record)
    mgr.resume(record, Principal("a", "user"))
    words = sent[-1]["entrypoint"].split()
    uri = words[words.index("-m") + 2]
    assert uri == str(tmp_path / "checked-specs" / "a" / f"{rid}.json")
    stored = Path(uri).read_bytes()
    assert json.loads(stored) == spec and words[words.index("--spec-sha256") + 1] == hashlib.sha256(stored).hexdigest()
    key = sent[-1]["runtime_env"]["env_vars"]["ETRAIN_STATE_KEY"]
    assert (len(key) == 64) if kind == "sweep" else key == ""
