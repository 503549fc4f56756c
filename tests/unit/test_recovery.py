"""Failure kinds, retry decisions and interruption records: table-driven."""

from __future__ import annotations

import pytest
from ray.exceptions import RayActorError
from ray.train.v2._internal.exceptions import UserExceptionWithTraceback, WorkerHealthCheckFailedError
from ray.train.v2.api.preemption import PreemptionInfo
from ray.train.v2.api.exceptions import ControllerError, PreemptionError, WorkerGroupError

from trainers.recovery import Heartbeat, classify_failure, interruption_record, should_retry


def group(*errors):
    return WorkerGroupError("x", dict(enumerate(errors)))


USER = UserExceptionWithTraceback(ValueError("bug"), "Traceback ... ValueError: bug")
DEAD = WorkerHealthCheckFailedError("worker died", RayActorError())


@pytest.mark.parametrize("error,kind", [
    (group(USER), "user_error"),
    (group(USER, USER), "user_error"),
    (group(DEAD), "node_lost"),
    (group(USER, DEAD), "node_lost"),  # survivors of a dead node fail with collective errors
    (group(RayActorError()), "node_lost"),
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
