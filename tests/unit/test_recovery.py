"""Failure kinds, retry decisions and interruption records: table-driven."""

from __future__ import annotations

import pytest
from ray.exceptions import RayActorError
from ray.train.v2._internal.exceptions import UserExceptionWithTraceback, WorkerHealthCheckFailedError
from ray.train.v2.api.exceptions import ControllerError, PreemptionError, WorkerGroupError
from ray.train.v2.api.preemption import PreemptionInfo
from torch.distributed import DistNetworkError

from trainers.recovery import (Heartbeat, classify_failure, interruption_record, launcher_cause, nodes_died,
                               settle_peer_lost, should_retry)


def group(*errors):
    return WorkerGroupError("x", dict(enumerate(errors)))


USER = UserExceptionWithTraceback(ValueError("bug"), "Traceback ... ValueError: bug")
DEAD = WorkerHealthCheckFailedError("worker died", RayActorError())
# What the rank that outlives a killed node got (gloo, seen in a run), before Ray saw the death.
# Ray hands the controller the rank's own exception (poll.py unwraps UserExceptionWithTraceback).
GLOO_RESET = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                          "[127.0.0.1]:61664: Connection reset by peer. This is typically caused by a remote worker")
GLOO_CLOSED = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer "
                           "[10.0.0.7]:50211")
STORE_LOST = RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown "
                          "or crash?")
# A user's own network trouble, in the same words a socket uses: not a lost peer.
USER_RESET = ConnectionResetError(104, "Connection reset by peer")
USER_ABORTED = RuntimeError("('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))")
USER_PIPE = BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize("error,kind", [
    (group(USER), "user_error"),
    (group(USER, USER), "user_error"),
    (group(DEAD), "node_lost"),
    (group(USER, DEAD), "node_lost"),  # survivors of a dead node fail with collective errors
    (group(RayActorError()), "node_lost"),
    (group(GLOO_RESET), "peer_lost"),  # the survivor's error came before Ray noticed its peer's death
    (group(GLOO_CLOSED, STORE_LOST), "peer_lost"),
    (group(DistNetworkError("store connection lost")), "peer_lost"),
    (group(GLOO_RESET, DEAD), "node_lost"),
    (group(USER, GLOO_RESET), "user_error"),  # a rank's own bug; the others lost it as a peer
    (group(USER_RESET), "user_error"),
    (group(USER_ABORTED), "user_error"),
    (group(USER_PIPE), "user_error"),
    (group(), "user_error"),
    (PreemptionError(PreemptionInfo(deadline_ms=1, preempted_node_to_ranks={"n": [1]})), "preemption"),
    (ControllerError(RuntimeError("controller bug")), "fatal"),
    (RuntimeError("anything else"), "fatal"),
])
def test_classify_failure(error, kind):
    assert classify_failure(error) == kind


@pytest.mark.parametrize("kind,user,max_user,infra,max_infra,retry", [
    ("user_error", 1, 3, 0, -1, True),
    ("user_error", 4, 3, 0, -1, False),
    ("user_error", 1, 0, 0, -1, False),
    ("user_error", 50, -1, 0, -1, True),
    ("node_lost", 3, 0, 7, -1, True),   # lost nodes never use the user's budget
    ("node_lost", 0, 0, 3, 2, False),
    ("preemption", 0, 0, 1, 0, False),
    ("fatal", 0, 3, 0, -1, False),
])
def test_should_retry(kind, user, max_user, infra, max_infra, retry):
    assert should_retry(kind, user, max_user, infra, max_infra) is retry


@pytest.mark.parametrize("beat,restored,world,now,expected", [
    (Heartbeat("r", 120, 100.0, 2, "preemption notice"), 120, 1, 104.5,
     {"cause": "preemption notice", "steps_lost": 0, "recovery_s": 4.5, "world_size_before": 2, "world_size_after": 1}),
    (Heartbeat("r", 137, 50.0, 2), 100, 2, 60.0,
     {"cause": "node lost", "steps_lost": 37, "recovery_s": 10.0, "world_size_before": 2, "world_size_after": 2}),
    (Heartbeat("r", 90, 50.0, 1), 100, 2, 51.0, {"steps_lost": 0}),  # a checkpoint newer than the last beat
])
def test_interruption_record(beat, restored, world, now, expected):
    record = interruption_record(beat, restored, world, now)
    assert {k: record[k] for k in expected} == expected


def test_the_cost_record_bills_the_lost_work_and_the_recovery():
    from cluster.metrics import NodeKind
    from trainers.observe import ledger_node_hours, open_segment

    spot, ondemand = NodeKind("g5.2xlarge", "spot"), NodeKind("g5.2xlarge", "on_demand")
    other_run = [{"run_id": "old", "start": 0.0, "end": 10.0, "nodes": [["g5.2xlarge", "spot", 1]]}]
    segments = open_segment(other_run, "r", 100.0, None, {spot: 2})
    segments[-1]["end"] = 160.0  # its last checkpoint; it died at its last heartbeat, 175
    segments = open_segment(segments, "r", 175.0, 175.0, {spot: 1, ondemand: 1})
    segments[-1]["end"] = 235.0
    assert segments[0]["end"] == 10.0, "another run's segment is never stretched"
    assert segments[1]["end"] == 175.0, "the work after the last checkpoint is billed"
    hours = ledger_node_hours(segments)
    assert hours[spot] * 3600 == pytest.approx(10 + 2 * 75 + 60) and hours[ondemand] * 3600 == pytest.approx(60)


def test_a_lost_peer_is_a_node_loss_only_when_ray_reports_a_node_dead():
    answers = iter([False, False, True])
    assert settle_peer_lost(lambda: next(answers), wait_s=5, poll_s=0) == "node_lost"
    checks = []
    assert settle_peer_lost(lambda: checks.append(1) or False, wait_s=0.05, poll_s=0.01) == "user_error"
    assert len(checks) >= 2, "it asked Ray more than once before charging the user"


def test_a_node_lost_a_moment_after_a_restart_is_recorded_once_as_a_node_loss(monkeypatch, tmp_path):
    """A spot notice ends attempt 1 (its last beat: the just-in-time checkpoint's); attempt 2 trains
    one step and records that interruption; its node is cut before its heartbeat thread ticks (the
    rehearsal cut it a second after the restart). Attempt 3 must record a node loss of attempt 2,
    not the notice again with its time and cause."""
    import time

    from cluster.storage import open_root
    from trainers import recovery
    from trainers.job_folder import INTERRUPTIONS_FILE
    from trainers.recovery import Heartbeats, StopFlag
    from trainers.worker_loop import Clock, Trainer
    from trainers.worker_services import Pulse

    store: dict[bytes, bytes] = {}
    monkeypatch.setattr(recovery, "kv_get", store.get)
    monkeypatch.setattr(recovery, "kv_put", store.__setitem__)
    monkeypatch.setattr(recovery, "kv_exists", store.__contains__)
    root = open_root(str(tmp_path))

    class Observer:
        def interruptions(self, records: list[dict]) -> None:
            pass

        def open_cost_segment(self, *args) -> None:
            pass

    def attempt(previous_failure: str | None) -> Trainer:
        """Rank 0 of an attempt restored at step 750, as far as its first step; its heartbeat thread
        is never started, so it never ticks."""
        trainer = object.__new__(Trainer)
        beats = Heartbeats("root/job", "run-1", interval_s=3600)
        trainer.pending_beat, trainer.pulse = beats.last(), Pulse(beats, StopFlag("root/job"), 2, interval_s=3600)
        trainer.config = {"run_id": "run-1", "previous_failure": previous_failure, "attempt_started_at": time.time()}
        trainer.clock, trainer.observer = Clock(time.perf_counter()), Observer()
        trainer.root, trainer.job, trainer.start, trainer.world = root, "job", 750, 2
        return trainer

    Pulse(Heartbeats("root/job", "run-1"), StopFlag("root/job"), 2).checkpointed(750, jit=True)
    attempt("preemption").take_over(751)
    time.sleep(0.01)
    attempt("node_lost").take_over(751)
    records = root.read_json("job", INTERRUPTIONS_FILE)
    assert [r["cause"] for r in records] == ["preemption notice", "node lost"], records
    assert records[1]["interrupted_at"] > records[0]["interrupted_at"], records
    assert records[1]["step_reached"] == 751, records


def test_a_beat_that_fails_at_the_first_step_does_not_end_the_attempt(monkeypatch):
    """Ray's GCS unreachable for a moment at step 1: the heartbeat is missed (a warning), training goes on."""
    from trainers import recovery
    from trainers.recovery import Heartbeats, StopFlag
    from trainers.worker_services import Pulse

    def refused(key, value):
        raise ConnectionError("GCS unavailable")

    monkeypatch.setattr(recovery, "kv_put", refused)
    Pulse(Heartbeats("root/job", "run-1"), StopFlag("root/job"), 2, interval_s=3600).took_over(1)


@pytest.mark.parametrize("before, now, died", [
    ({"a": True, "b": True}, {"a": True, "b": True}, set()),
    ({"a": True, "b": True}, {"a": True, "b": False}, {"b"}),                 # listed dead
    ({"a": True, "b": True}, {"a": True}, {"b"}),                             # gone from the list
    ({"a": True}, {"a": True, "c": False}, {"c"}),                            # joined mid-fit, then died
    ({"a": True}, {"a": True, "c": True}, set()),                             # joined, still alive
    ({"a": True, "old": False}, {"a": True, "old": False}, set()),             # dead before the fit began
    ({"a": True, "old": False}, {"a": True}, set()),                          # ... and since forgotten
])
def test_nodes_died_since_a_fit_began(before, now, died):
    assert nodes_died(before, now) == died


@pytest.mark.parametrize("beat,attempt,want", [
    (Heartbeat("r", 11, 100.0, 2, attempt=90.0), 101.0, "user_error"),   # the failed attempt's beat
    (Heartbeat("r", 11, 102.0, 2, attempt=90.0), 101.0, "user_error"),   # ... written after the next began
    (Heartbeat("r", 11, 105.0, 2, attempt=101.0), 101.0, None),          # a restart inside this attempt
    (Heartbeat("r", 11, 102.0, 2), 101.0, "user_error"),                 # a beat that names no attempt: not this one
])
def test_the_launchers_cause_names_an_interruption_by_the_attempt_that_beat_last(beat, attempt, want):
    assert launcher_cause(beat, attempt, "user_error") == want


def test_a_beat_carries_its_attempt(monkeypatch):
    import json

    import trainers.recovery as recovery
    from trainers.recovery import Heartbeats

    kv = {}
    monkeypatch.setattr(recovery, "kv_put", kv.__setitem__)
    monkeypatch.setattr(recovery, "kv_get", kv.get)
    Heartbeats("root/job", "run-1", attempt=90.0).beat(11, 2, force=True)
    assert json.loads(kv[b"root/job/heartbeat"])["attempt"] == 90.0
    assert Heartbeats("root/job", "run-1", attempt=101.0).last().attempt == 90.0


def test_a_stop_asked_in_storage_reaches_a_job_whose_ray_the_asker_cannot_reach(tmp_path, monkeypatch):
    """The service's jobs may run on a cluster apart from its own Ray: it asks for a stop by a file in
    the job's folder, which rank 0 reads (at most every STOP_FILE_POLL_S) beside Ray's KV."""
    from cluster.storage import open_root
    from trainers import recovery
    from trainers.recovery import STOP_FILE_POLL_S, StopFlag

    kv: dict[bytes, bytes] = {}  # the job's own Ray: the asker never writes here
    monkeypatch.setattr(recovery, "kv_exists", kv.__contains__)
    monkeypatch.setattr(recovery, "kv_del", lambda key: kv.pop(key, None))
    root = open_root(str(tmp_path))
    asker, job = StopFlag("etrain/j-1-x", (root, "j-1")), StopFlag("etrain/j-1-x", (root, "j-1"))
    job.clear()  # at start, nothing to clear
    assert not job.requested(now=100.0)
    asker.request_in_storage()
    assert not job.requested(now=100.0 + STOP_FILE_POLL_S / 2)  # storage is read at most every poll interval
    assert job.requested(now=100.0 + STOP_FILE_POLL_S)
    job.clear()  # the launcher's, at the next attempt: a resumed job runs on
    assert not (tmp_path / "j-1" / recovery.STOP_REQUEST_FILE).exists()
    assert not StopFlag("etrain/j-1-x", (root, "j-1")).requested(now=200.0)
