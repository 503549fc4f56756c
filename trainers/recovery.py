"""Failures and interruptions: what kind each is, whether to retry, and what it cost.

Infrastructure failures (a preemption, a lost node) never use up the user's
``fault_tolerance.max_failures``; errors in user code do. Ray Train hands every failure
back to the launcher, which classifies it with :func:`classify_failure` and asks
:func:`should_retry`. Every retry resumes from the newest verified checkpoint.

Recovery accounting: rank 0 leaves a heartbeat (step, time, world size, cause) in Ray's
GCS key-value store at most once a second and at every checkpoint. The first step of the
next attempt reads it back and records an interruption: cause, steps lost (work re-done),
seconds from the interruption to that step, world size before and after. The records are
kept under the job's folder in storage and shown in the run summary.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Literal

from cluster.ray_adapter import kv_del, kv_exists, kv_get, kv_put

FailureKind = Literal["preemption", "node_lost", "user_error", "fatal"]
INTERRUPTIONS_FILE = "interruptions.json"
HEARTBEAT_INTERVAL_S = 1.0


# How a collective fails on the ranks that outlive a peer's process or node (gloo's TCP transport,
# torch's store, NCCL): the last line of the rank's traceback.
PEER_LOST_MARKERS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "DistNetworkError",
                     "NCCL communicator was aborted")


def peer_lost(failure: BaseException) -> bool:
    """Whether a rank failed only because a peer went away (its own code did nothing wrong)."""
    lines = str(failure).strip().splitlines()
    return bool(lines) and any(marker in lines[-1] for marker in PEER_LOST_MARKERS)


def classify_failure(error: BaseException) -> FailureKind:
    """What a failed ``fit()`` means. A dead worker anywhere makes it infrastructure: when a
    node dies, the surviving ranks fail too, with collective errors that look like user errors.
    Ray may not have noticed the death yet when the survivors' errors arrive (its health check
    takes seconds, the controller polls every 0.5 s): if every failed rank only lost a peer, the
    peer's node is gone. A user's own error on any rank makes it the user's."""
    from ray.exceptions import RayActorError
    from ray.train.v2.api.exceptions import PreemptionError, WorkerGroupError

    from cluster.ray_adapter import worker_death_errors

    if isinstance(error, PreemptionError):
        return "preemption"
    if isinstance(error, WorkerGroupError):
        failures = list(error.worker_failures.values())
        infra = (*worker_death_errors(), RayActorError)
        if any(isinstance(e, infra) for e in failures):
            return "node_lost"
        if failures and all(peer_lost(e) for e in failures):
            return "node_lost"
        return "user_error"
    return "fatal"


def should_retry(kind: FailureKind, user_failures: int, max_failures: int, infra_failures: int,
                 max_infra_failures: int) -> bool:
    """Retry or give up; counts include the failure being decided. -1 means no limit."""
    if kind == "fatal":
        return False
    if kind == "user_error":
        return max_failures == -1 or user_failures <= max_failures
    return max_infra_failures == -1 or infra_failures <= max_infra_failures


@dataclass(frozen=True)
class Heartbeat:
    run_id: str
    step: int
    time: float
    world_size: int
    cause: str | None = None  # "preemption notice" | "user error" when the loop knew why it stopped


def interruption_record(last: Heartbeat, restored_step: int, world_size: int, now: float) -> dict:
    """One interruption, from the last heartbeat of the attempt that died and the new one's first step."""
    return {
        "cause": last.cause or "node lost",
        "interrupted_at": last.time,
        "recovery_s": round(now - last.time, 3),
        "steps_lost": max(0, last.step - restored_step),
        "step_reached": last.step,
        "restored_step": restored_step,
        "world_size_before": last.world_size,
        "world_size_after": world_size,
        "run_id": last.run_id,
    }


class Heartbeats:
    """Rank 0's heartbeat in Ray's GCS key-value store (it outlives the workers, not the cluster)."""

    def __init__(self, job_key: str, run_id: str, interval_s: float = HEARTBEAT_INTERVAL_S):
        """``job_key``: the job's name in Ray's KV (trainers.home.JobHome.key), never its bare name."""
        self.key = f"{job_key}/heartbeat".encode()
        self.run_id = run_id
        self.interval_s = interval_s
        self._last = 0.0

    def last(self) -> Heartbeat | None:
        """The previous attempt's heartbeat in this run, if any."""
        raw = kv_get(self.key)
        if not raw:
            return None
        beat = Heartbeat(**json.loads(raw))
        return beat if beat.run_id == self.run_id else None

    def beat(self, step: int, world_size: int, cause: str | None = None, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        kv_put(self.key, json.dumps(asdict(Heartbeat(self.run_id, step, now, world_size, cause))))


class StopFlag:
    """A request to stop a job gracefully (final checkpoint, then exit), kept in Ray's GCS KV.

    The service's stop route and `etrain run`'s Ctrl-C set it; rank 0 reads it at log steps
    and the decision rides on the all-reduce those steps already do, so every rank stops at
    the same step and checking costs no extra collective. The launcher clears it at start,
    so a resumed job runs on.
    """

    def __init__(self, job_key: str):
        """``job_key``: the job's name in Ray's KV (trainers.home.JobHome.key): two jobs of one name
        in two storage roots have two keys, so one's stop never stops or clears the other's."""
        self.key = f"{job_key}/stop".encode()

    def request(self) -> None:
        kv_put(self.key, str(time.time()).encode())

    def requested(self) -> bool:
        return kv_exists(self.key)

    def clear(self) -> None:
        kv_del(self.key)
