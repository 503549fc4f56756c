"""Ray's Jobs API is an outside service that fails like one (5xx, timeouts, refused connections):
what its errors mean, and how a record is backed off after one.

Only Ray's own "no such job" (404) says a submission is gone; any other error leaves the record
as it is, says so on the record, in the log and on the service's counter, and the record is tried
again after a back-off that doubles with each failure in a row.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable

from service.store import Record, Store

log = logging.getLogger(__name__)


class RayUnavailable(Exception):
    """Ray's Jobs API did not answer (or no longer has the submission); the message says which."""

    def __init__(self, message: str, missing: bool = False):
        super().__init__(message)
        self.missing = missing


def ray_error_status(exc: BaseException) -> int | None:
    """The HTTP status in an error from Ray's JobSubmissionClient, None when there was no answer.

    The client raises RuntimeError("Request failed with status code 404: ...") for any
    non-200 (dashboard_sdk._raise_error); tests/unit/test_reconcile.py checks that wording
    against the real client, so a change in Ray fails there, not here in production.
    """
    match = re.search(r"status code (\d{3})", str(exc)) if isinstance(exc, RuntimeError) else None
    return int(match.group(1)) if match else None


def submission_retryable(exc: BaseException) -> bool:
    """Whether Ray's Jobs API said "not now" to a submission rather than "no".

    A head whose job agent has not registered yet answers 500 "No available agent to submit
    job, please try again later"; a restarting or overloaded dashboard answers 502/503/504 or
    not at all. A 4xx, or any other 500, is a refusal that sending again would not change.
    """
    import requests

    if isinstance(exc, (requests.ConnectionError, requests.Timeout, ConnectionError, TimeoutError)):
        return True
    status = ray_error_status(exc)
    return status in (502, 503, 504) or (status == 500 and "try again later" in str(exc))


def backoff_s(failures: int, base_s: float, cap_s: float = 60.0) -> float:
    """How long to leave a record alone after ``failures`` failed passes in a row."""
    return min(cap_s, base_s * 2 ** max(0, failures - 1)) if failures else 0.0


class Failures:
    """Failed steps per record, in a row, and when the record may be tried again."""

    def __init__(self, store: Store, lock: threading.RLock, base_s: float):
        self.store, self.lock, self.base_s = store, lock, base_s
        self.on_error: Callable[[str], None] | None = None  # called with the kind of each failed step (a counter)
        self._by_record: dict[str, tuple[int, float]] = {}  # record id -> (failed steps in a row, retry at)

    def failed(self, record_id: str, kind: str, reason: str) -> None:
        """One failed step for a record: on the record (error), in the log, on the counter; back off."""
        failures = self._by_record.get(record_id, (0, 0.0))[0] + 1
        wait_s = backoff_s(failures, self.base_s)
        self._by_record[record_id] = (failures, time.monotonic() + wait_s)
        message = f"{reason} (failure {failures} in a row; next try in {wait_s:.0f}s)"
        log.warning("%s: %s", record_id, message)
        self.count(kind)
        with self.lock:
            record = self.store.get(record_id)
            if record is not None and record.error != message:
                record.error = message
                self.store.save(record)

    def count(self, kind: str) -> None:
        if self.on_error:
            self.on_error(kind)

    def recovered(self, record: Record) -> None:
        """A step worked again after failing: the back-off ends and the record's error is cleared."""
        if self._by_record.pop(record.id, None) and record.error:
            record.error = None
            self.store.save(record)

    def forget(self, record_id: str) -> None:
        """Start the count afresh (a new attempt, or one Ray took)."""
        self._by_record.pop(record_id, None)

    def retry_at(self, record_id: str) -> float:
        """When (time.monotonic) the record may be tried again; 0 when it has not failed."""
        return self._by_record.get(record_id, (0, 0.0))[1]
