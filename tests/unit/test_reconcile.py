"""The reconciler under Ray's Jobs API faults: 5xx, 404, refused connections, a stop that fails.

One test runs Ray's real JobSubmissionClient against a tiny HTTP server that answers like a
dashboard under trouble, so the meaning of its errors is checked against the client itself;
the others use a fake client at the edge to drive the decisions.
"""

from __future__ import annotations

import time

import pytest
from fake_jobs_api import FakeClient, FakeDashboard, manager, running_record

from service.jobs import JobManager
from service.reconcile import reconcile_decision
from service.settings import ServiceSettings
from service.states import RayStatus

DECISIONS = [
    # state, Ray's status of the latest attempt, the run's own summary status -> next state, action
    ("RUNNING", "RUNNING", None, "RUNNING", None),
    ("PENDING", "PENDING", None, "RUNNING", None),
    ("STOPPING", "RUNNING", None, "STOPPING", None),
    ("RUNNING", "SUCCEEDED", "succeeded", "SUCCEEDED", None),
    ("RUNNING", "FAILED", "stopped", "STOPPED", None),  # exit 3: stopped with a checkpoint
    ("STOPPING", "FAILED", "stopped", "STOPPED", None),
    ("RUNNING", "FAILED", "failed", "FAILED", None),
    ("RUNNING", "FAILED", None, "FAILED", None),
    ("STOPPING", "STOPPED", None, "STOPPED", None),  # Ray's stop after the grace period
    ("RUNNING", "MISSING", None, "RUNNING", "resubmit"),  # Ray lost it (head restarted): resubmit, it resumes
    ("PENDING", None, None, "RUNNING", "resubmit"),  # stored but never sent (the replica died in between)
    ("STOPPING", "MISSING", None, "STOPPED", None),
    ("SUCCEEDED", "MISSING", None, "SUCCEEDED", None),  # finished records are never touched
    ("FAILED", "RUNNING", None, "FAILED", None),
    ("RUNNING", "UNREACHABLE", None, "RUNNING", "wait"),  # a 5xx or a timeout is no news: back off
    ("STOPPING", "UNREACHABLE", None, "STOPPING", "wait"),
    ("PENDING", "UNREACHABLE", None, "PENDING", "wait"),
]


@pytest.mark.parametrize("state,ray_status,outcome,expected,action", DECISIONS)
def test_reconcile_decision(state, ray_status, outcome, expected, action):
    assert reconcile_decision(state, ray_status, outcome) == (expected, action)


def test_a_503_from_the_jobs_api_never_resubmits_and_a_404_does(tmp_path, monkeypatch):
    from ray.job_submission import JobSubmissionClient

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    dash = FakeDashboard()
    try:
        mgr = manager(tmp_path, JobSubmissionClient(dash.url))
        running_record(mgr)
        for _ in range(3):
            mgr.reconciler.reconcile_one("j-abc")
        record = mgr.store.get("j-abc")
        assert dash.posts == [], "a 503 is no news about the job: a second driver must not start"
        assert record.state == "RUNNING" and record.submissions == ["etrain-j-abc-0"]
        assert "did not answer" in record.error and "503" in record.error
        dash.status_code = 404  # now Ray really does not know the submission (its head restarted)
        record = mgr.reconciler.reconcile_one("j-abc")
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
        record, created = mgr.submitter.create("job", Principal("team-a", "user"), {"name": "agentless"}, None, "")
        assert created and record.state == "PENDING", record
        assert "did not take submission etrain-" in record.error and "try again later" in record.error
        assert "next try in" in record.error
        for _ in range(100):
            record = mgr.reconciler.reconcile_one(record.id) if time.monotonic() > mgr.context.failures.retry_at(record.id) \
                else mgr.store.get(record.id)
            if record.state == "RUNNING":
                break
            time.sleep(0.01)
        assert record.state == "RUNNING" and record.error is None, record
        sids = [p["submission_id"] for p in dash.posts]
        assert sids == [record.submissions[0]] * 3 and len(record.submissions) == 1, "one attempt, sent three times"

        dash.post_answers = [(400, "runtime_env: bad field")]
        refused, _ = mgr.submitter.create("job", Principal("team-a", "user"), {"name": "refused"}, None, "")
        assert refused.state == "FAILED" and "Ray refused the submission" in refused.error
        assert "bad field" in refused.error
    finally:
        dash.close()


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
    mgr.reconciler.stop(record)
    deadline = time.time() + 30
    while mgr.store.get("j-abc").state == "STOPPING" and time.time() < deadline:
        mgr.reconciler.reconcile_all()
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
    record = mgr.reconciler.reconcile_one(record.id)
    assert record.state == "STOPPING" and "Ray did not stop etrain-j-abc-0" in record.error
    assert "next try in 30s" in record.error
    mgr.reconciler.reconcile_all()  # inside the back-off: Ray is left alone
    assert client.calls.count("stop_job") == 1


def test_a_missing_latest_submission_is_not_resubmitted_while_an_earlier_one_runs(tmp_path):
    client = FakeClient()
    mgr = manager(tmp_path, client)
    record = running_record(mgr)
    record.submissions.append("etrain-j-abc-1")  # saved, then the replica died before Ray heard of it
    mgr.store.save(record)
    client.alive = ["etrain-j-abc-0"]
    assert mgr.reconciler.reconcile_one(record.id).submissions == ["etrain-j-abc-0", "etrain-j-abc-1"]
    assert "submit_job" not in client.calls
    client.alive = []
    assert mgr.reconciler.reconcile_one(record.id).submissions[-1] == "etrain-j-abc-2"


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
