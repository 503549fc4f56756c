"""The job states, named once: where a record is, and what the reconciler may learn of its Ray submission.

The members are strings (``JobState.RUNNING == "RUNNING"``, and ``str()`` or an f-string gives
the bare name), so stored records, API answers and messages read as they did with plain strings.
tests/unit/test_states.py keeps every other service module from spelling a state by hand.
"""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    """Where a job or sweep is, as its record stores it and the API shows it."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    def __str__(self) -> str:  # the bare name in messages on every Python (3.12 formats a mixin by its str)
        return self.value


TERMINAL: frozenset[JobState] = frozenset({JobState.STOPPED, JobState.SUCCEEDED, JobState.FAILED})
ACTIVE: frozenset[JobState] = frozenset({JobState.PENDING, JobState.RUNNING, JobState.STOPPING})
RESUMABLE: tuple[JobState, ...] = (JobState.STOPPED, JobState.FAILED)
# A query parameter that filters by state: exactly one of the names.
STATE_PATTERN = f"^({'|'.join(JobState)})$"


class RayStatus(str, Enum):
    """What the reconciler learns of a submission: Ray's own JobStatus names (pinned against
    ray.job_submission.JobStatus by tests/unit/test_states.py), and two answers of ours."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    MISSING = "MISSING"  # Ray answered 404: it does not know the submission (its job table died with the head)
    UNREACHABLE = "UNREACHABLE"  # no answer we can act on: 5xx, timeout, refused connection

    def __str__(self) -> str:
        return self.value


RAY_ALIVE: frozenset[RayStatus] = frozenset({RayStatus.PENDING, RayStatus.RUNNING})
