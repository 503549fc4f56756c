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
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

from cluster.ray_adapter.kv import kv_del, kv_exists, kv_get, kv_put
from trainers.job_folder import STOP_REQUEST_FILE

FailureKind = Literal["preemption", "node_lost", "peer_lost", "user_error", "fatal"]
HEARTBEAT_INTERVAL_S = 1.0


# How torch's collectives fail on the ranks that outlive a peer's process or node: gloo's TCP
# transport (its source file names the line) and the rendezvous store. Only torch's own wording:
# a user's ConnectionResetError from an HTTP download must not look like a lost peer.
PEER_LOST = re.compile(r"gloo/transport/tcp/pair\.cc:\d+\].*(Connection reset by peer|Connection closed by peer)"
                       r"|Failed to recv, got 0 bytes")


def peer_lost(failure: BaseException) -> bool:
    """Whether a rank failed in a collective because a peer went away (torch's own error)."""
    import torch.distributed as dist

    return isinstance(failure, dist.DistNetworkError) or bool(PEER_LOST.search(str(failure)))


def classify_failure(error: BaseException) -> FailureKind:
    """What a failed ``fit()`` means. A dead worker anywhere makes it infrastructure: when a
    node dies, the surviving ranks fail too, with collective errors that look like user errors.
    When every failed rank only lost a peer, Ray may not have noticed the death yet (its health
    check takes seconds; the controller polls every 0.5 s): that is ``peer_lost``, which the
    caller settles by asking Ray whether a node of the group died (:func:`settle_peer_lost`)."""
    from ray.exceptions import RayActorError
    from ray.train.v2.api.exceptions import PreemptionError, WorkerGroupError

    from cluster.ray_adapter.train_torch import worker_death_errors

    if isinstance(error, PreemptionError):
        return "preemption"
    if isinstance(error, WorkerGroupError):
        failures = list(error.worker_failures.values())
        infra = (*worker_death_errors(), RayActorError)
        if any(isinstance(e, infra) for e in failures):
            return "node_lost"
        if failures and all(peer_lost(e) for e in failures):
            return "peer_lost"
        return "user_error"
    return "fatal"


def settle_peer_lost(node_died: Callable[[], bool], wait_s: float, poll_s: float = 0.5) -> FailureKind:
    """A peer vanished: a node loss if Ray reports a node of the cluster dead within ``wait_s``,
    else the user's (a rank's own code stopped taking part): never an endless free retry."""
    deadline = time.monotonic() + wait_s
    while True:
        if node_died():
            return "node_lost"
        if time.monotonic() >= deadline:
            return "user_error"
        time.sleep(poll_s)


def nodes_died(before: dict[str, bool], now: dict[str, bool]) -> set[str]:
    """Nodes dead now that were not already dead ``before`` (``node id -> alive`` maps from Ray's node
    list): one alive then and dead or gone from the list now, and one that joined after ``before``
    (an elastic group grows onto it inside the same fit) and is listed dead now."""
    return ({n for n, alive in before.items() if alive and not now.get(n, False)}
            | {n for n, alive in now.items() if not alive and n not in before})


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
    attempt: float = 0.0  # the launcher attempt that wrote it (its start time); 0.0: not known


def launcher_cause(pending: Heartbeat, attempt: float, previous_failure: str | None) -> str | None:
    """The launcher's verdict on the failure before this attempt (``previous_failure``) describes the
    interruption ``pending`` ended only when that beat was written by an earlier launcher attempt; a
    beat of this attempt means Ray Train restarted the group inside it (a resize), which the launcher
    never saw. Judged by the attempt the beat names, not by its time: the failed attempt's rank 0
    can still beat after the launcher has started the next one (its heartbeat thread runs until
    Ray kills the process), and a full run then recorded a user error as 'node lost'."""
    return previous_failure if pending.attempt != attempt else None


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

    def __init__(self, job_key: str, run_id: str, interval_s: float = HEARTBEAT_INTERVAL_S, attempt: float = 0.0):
        """``job_key``: the job's name in Ray's KV (trainers.job_folder.JobHome.key), never its bare name;
        ``attempt``: the launcher attempt this worker belongs to, written into each beat."""
        self.key = f"{job_key}/heartbeat".encode()
        self.run_id, self.attempt = run_id, attempt
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
        kv_put(self.key, json.dumps(asdict(Heartbeat(self.run_id, step, now, world_size, cause, self.attempt))))


STOP_FILE_POLL_S = 2.0


class StopFlag:
    """A request to stop a job gracefully (final checkpoint, then exit): in Ray's GCS KV, and as a
    file in the job's folder in storage.

    `etrain run`'s Ctrl-C sets the KV key (the driver and the job share a Ray). The service writes
    the file: its jobs may run on a cluster apart from the service's own Ray, whose KV the service
    cannot reach, while both reach the storage root. Rank 0 reads both off the step path (the file
    at most every STOP_FILE_POLL_S) and the decision rides on the all-reduce the log steps already
    do, so every rank stops at the same step and checking costs no extra collective. The launcher
    clears both at start, so a resumed job runs on.
    """

    def __init__(self, job_key: str, folder: tuple | None = None):
        """``job_key``: the job's name in Ray's KV (trainers.job_folder.JobHome.key): two jobs of one name
        in two storage roots have two keys, so one's stop never stops or clears the other's.
        ``folder``: (StorageRoot, the job's folder under it) for the file; None: the KV key only."""
        self.key = f"{job_key}/stop".encode()
        self.folder = folder
        self._file_checked_at = float("-inf")

    def request(self) -> None:
        kv_put(self.key, str(time.time()).encode())

    def request_in_storage(self) -> None:
        root, job = self.folder
        root.write_json({"requested_at": time.time()}, job, STOP_REQUEST_FILE)

    def requested(self, now: float | None = None) -> bool:
        if kv_exists(self.key):
            return True
        now = time.monotonic() if now is None else now
        if self.folder is None or now - self._file_checked_at < STOP_FILE_POLL_S:
            return False
        self._file_checked_at = now
        root, job = self.folder
        return root.exists(job, STOP_REQUEST_FILE)

    def clear(self) -> None:
        kv_del(self.key)
        if self.folder is not None:
            root, job = self.folder
            try:
                root.fs.delete_file(root.path(job, STOP_REQUEST_FILE))
            except FileNotFoundError:
                pass  # none asked: nothing to clear
