"""The reconciler: keeps each unfinished record in step with what Ray says of its submissions, and
sees a stop through (a final checkpoint first; Ray's stop only after the grace period).

Ray's job table dies with the head node; our records do not: a record whose Ray job vanished is
resubmitted, and it resumes from its newest checkpoint. Only Ray's own "no such job" (404) for the
latest submission, with no other submission of the record alive, counts as "the job vanished";
any other error leaves the record as it is and backs it off (service.ray_failures).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Literal

from service.context import JobsContext
from service.ray_failures import ray_error_status
from service.states import RAY_ALIVE, TERMINAL, JobState, RayStatus
from service.store import Record
from service.submit import Conflict, Submitter
from service.views import Views
from trainers import api as trainers

log = logging.getLogger(__name__)

Action = Literal["resubmit", "send", "stop", "wait"] | None


def reconcile_decision(state: str, ray_status: str | None, outcome: str | None, others_alive: bool = False,
                       stop_overdue: bool = False) -> tuple[str, Action]:
    """(next state, action) from Ray's view of the latest attempt and the run's own summary.

    ``ray_status`` is a RayStatus: Ray's status, MISSING (Ray answered 404), UNREACHABLE (no
    usable answer), or None (never submitted); ``outcome`` is the status in the run's summary
    (succeeded/stopped/failed); ``others_alive``: another submission of the record still runs
    in Ray; ``stop_overdue``: a graceful stop's grace period is over and Ray still runs it.
    Actions: resubmit (the job is known gone), send (the submission Ray never took, same id),
    stop (ask Ray again), wait (back off, retry).
    """
    if state in TERMINAL:
        return state, None
    if ray_status == RayStatus.UNREACHABLE:
        return state, "wait"
    if ray_status in (None, RayStatus.MISSING):
        if state == JobState.STOPPING:
            return JobState.STOPPED, None
        if state == JobState.PENDING and ray_status == RayStatus.MISSING:  # Ray never took it: send the same id again
            return JobState.PENDING, "send"
        return JobState.RUNNING, (None if others_alive else "resubmit")
    if ray_status in RAY_ALIVE:
        if state == JobState.STOPPING:
            return JobState.STOPPING, ("stop" if stop_overdue else None)
        return JobState.RUNNING, None
    if ray_status == RayStatus.STOPPED or outcome == "stopped":
        return JobState.STOPPED, None
    if ray_status == RayStatus.SUCCEEDED:
        return JobState.SUCCEEDED, None
    return JobState.FAILED, None


class Reconciler:
    """Carries out reconcile_decision for each unfinished record, every interval and after a stop."""

    def __init__(self, context: JobsContext, submitter: Submitter, views: Views):
        self.context, self.submitter, self.views = context, submitter, views
        self.on_reconciled: Callable[[list[Record]], None] | None = None  # every record after each pass (gauges)
        self._last_ray_error = ""

    # ------------------------------------------------------------ stop

    def stop(self, record: Record) -> Record:
        """Graceful: ask for a final checkpoint; Ray's stop (SIGTERM, then SIGKILL) only after stop_wait_s."""
        with self.context.lock:
            record = self.context.store.get(record.id)
            if record.state in TERMINAL:
                raise Conflict(f"{record.kind} {record.id} is already {record.state}: nothing to stop")
            if record.state == JobState.STOPPING:
                return record
            if record.kind == "job":  # in storage, which the jobs reach wherever their Ray is
                trainers.request_stop(record.spec)
            record.move(JobState.STOPPING, "stop requested")
            self.context.store.save(record)
        sid = record.submissions[-1] if record.submissions else None
        if sid:
            grace = self.context.settings.stop_wait_s if record.kind == "job" else 0.0
            threading.Thread(target=self._escalate, args=(record.id, sid, grace), daemon=True).start()
        return record

    def _escalate(self, record_id: str, sid: str, grace_s: float) -> None:
        deadline = time.time() + grace_s
        while time.time() < deadline:
            if self._ray_status(sid) not in RAY_ALIVE:
                break
            time.sleep(0.5)
        else:
            self._ray_stop(record_id, sid)
        self.reconcile_one(record_id)

    def _ray_stop(self, record_id: str, sid: str) -> bool:
        """Ask Ray to stop a submission (SIGTERM, which our driver turns into a checkpointed stop).

        A failure is said on the record and in the log; the reconciler asks again each pass.
        """
        try:
            self.context.client.stop_job(sid)
            return True
        except Exception as exc:  # boundary: Ray's HTTP API; the next reconcile pass retries
            self.context.failures.failed(record_id, "stop", f"Ray did not stop {sid} ({type(exc).__name__}: "
                                         f"{str(exc)[:200]}); asking again at the next reconcile pass")
            return False

    def stop_overdue(self, record: Record, now: float) -> bool:
        """Whether a graceful stop's grace period is over (from the record's STOPPING transition)."""
        since = next((t.at for t in reversed(record.history) if t.state == JobState.STOPPING), record.updated_at)
        grace = self.context.settings.stop_wait_s if record.kind == "job" else 0.0
        return now - since > grace

    # ------------------------------------------------------------ what Ray says

    def _ray_status(self, sid: str) -> str:
        """Ray's status of a submission, MISSING (404) or UNREACHABLE (any other failure)."""
        try:
            return str(self.context.client.get_job_status(sid).value)
        except Exception as exc:  # boundary: Ray's HTTP API; only a 404 means "no such submission"
            if ray_error_status(exc) == 404:
                return RayStatus.MISSING
            self._last_ray_error = f"{type(exc).__name__}: {str(exc)[:300]}"
            return RayStatus.UNREACHABLE

    def _others_alive(self, record: Record) -> bool | None:
        """Whether Ray still runs an earlier submission of the record; None when Ray did not say."""
        try:
            jobs = self.context.client.list_jobs()
        except Exception as exc:  # boundary: Ray's HTTP API; the caller backs off
            self._last_ray_error = f"{type(exc).__name__}: {str(exc)[:300]}"
            return None
        return any(j.submission_id in record.submissions and str(j.status.value) in RAY_ALIVE
                   for j in jobs)

    # ------------------------------------------------------------ reconcile

    def reconcile_one(self, record_id: str) -> Record | None:
        store, failures = self.context.store, self.context.failures
        with self.context.lock:
            record = store.get(record_id)
            if record is None or record.state in TERMINAL:
                return record
            sid = record.submissions[-1] if record.submissions else None
            ray_status = self._ray_status(sid) if sid else None
            others_alive = False
            if ray_status == RayStatus.MISSING and len(record.submissions) > 1:
                alive = self._others_alive(record)
                ray_status, others_alive = (RayStatus.UNREACHABLE, False) if alive is None else (ray_status, alive)
            summary = self.views.summary_of(record) if ray_status not in (*RAY_ALIVE, RayStatus.UNREACHABLE) else None
            outcome = (summary or {}).get("status") if record.kind == "job" else None
            state, action = reconcile_decision(record.state, ray_status, outcome, others_alive,
                                               self.stop_overdue(record, time.time()))
            if action == "wait":
                failures.failed(record_id, "status", f"Ray's Jobs API did not answer for {sid} "
                                f"({self._last_ray_error}); the record is kept as it is")
                return store.get(record_id)
            if summary is not None:
                record.summary = summary
            if action == "send":
                return self.submitter.send(record, reason="submitted to Ray")
            if action == "resubmit":
                failures.forget(record_id)
                return self.submitter.submit(record, reason="Ray lost the job (head restarted?): resubmitted from "
                                                            "its checkpoint")
            if action == "stop" and not self._ray_stop(record_id, sid):
                return store.get(record_id)
            failures.recovered(record)
            if record.move(state, f"Ray says {ray_status}") or summary is not None:
                store.save(record)
            return record

    def reconcile_all(self) -> bool:
        """One pass over the unfinished records; False when it failed (said in the log, retried next pass).

        Each record is guarded on its own, so one that fails never starves the others, and the
        whole pass is guarded, so the reconciler thread outlives anything a pass meets.
        """
        store, failures = self.context.store, self.context.failures
        ok = True
        try:
            now = time.monotonic()
            for record in store.all():
                if record.state in TERMINAL or failures.retry_at(record.id) > now:
                    continue
                try:
                    self.reconcile_one(record.id)
                except Exception as exc:  # boundary: one record's failure is retried, the rest go on
                    ok = False
                    failures.failed(record.id, "reconcile", f"reconcile failed: {type(exc).__name__}: {str(exc)[:300]}")
            if self.on_reconciled:
                self.on_reconciled(store.all())
        except Exception as exc:  # boundary: the store itself failed; the next pass retries
            log.warning("reconcile pass failed: %s: %s", type(exc).__name__, exc)
            failures.count("pass")
            return False
        return ok

    def run(self, stop: threading.Event) -> None:
        """Reconcile at once, then every interval, until ``stop``; no error ends the loop."""
        while True:
            self.reconcile_all()
            if stop.wait(self.context.settings.reconcile_interval_s):
                return
