"""The one door the service (service/) uses into trainers: check a spec without running what it
names, a job's folder and key, ask a job to stop, read what a job wrote.

Everything here validates with imports off (``refs_not_imported``): the service never imports a
module a spec names, only its job does. A guard test (tests/unit/test_layers.py) keeps every other
trainers module out of service/ (its command line may compose ``trainers.cli`` besides).
"""

from __future__ import annotations

from typing import Any

from cluster.storage import StorageRoot
from trainers import checkpoint_files as _checkpoint
from trainers.config.errors import SpecError
from trainers.config.fields import REF_PATTERN, refs_not_imported
from trainers.config.job import NAME_PATTERN, JobSpec
from trainers.config.loading import apply_overrides, read_spec_file, validate
from trainers.config.parsing import parse_text
from trainers.console import strip_ansi
from trainers.history import read_history, read_history_tail
from trainers.job_folder import INTERRUPTIONS_FILE, JOB_FILE, SUMMARY_FILE, SWEEP_RESULTS_FILE, JobHome, job_home
from trainers.recovery import StopFlag
from trainers.sweep.spec import SweepPlan, candidate_values, plan_from_data, trial_spec_view

__all__ = ["NAME_PATTERN", "REF_PATTERN", "INTERRUPTIONS_FILE", "JOB_FILE", "SUMMARY_FILE", "SWEEP_RESULTS_FILE", "SpecError", "SweepPlan", "apply_overrides",
           "check_job", "check_sweep", "checkpoints_in", "home_of", "parse_text", "profiles", "read_history",
           "read_history_tail", "read_spec_file", "release_local_ray", "request_stop", "run_folder_of",
           "start_local_ray", "strip_ansi", "trial_spec_view", "trial_specs"]


def check_job(data: dict) -> JobSpec:
    """A job spec checked by its shape, importing nothing it names (SpecError lists every problem)."""
    with refs_not_imported():
        return validate(data)


def check_sweep(data: dict, source: str = "sweep") -> SweepPlan:
    """A sweep (a job spec with a ``sweep`` section, inline) checked likewise."""
    with refs_not_imported():
        return plan_from_data(data, source)


def trial_specs(plan: SweepPlan) -> list[JobSpec]:
    """The base job spec and one trial spec per value a sweep lists (both ends of a range): what any
    trial may ask for is among them, field by field."""
    specs = [plan.spec]
    with refs_not_imported():
        for key, domain in plan.sweep.space.items():
            specs.extend(validate(trial_spec_view(plan.base, key, v)) for v in candidate_values(domain))
    return specs


def home_of(spec: dict) -> JobHome:
    """A job's folder and key as its driver derives them, from the stored spec."""
    with refs_not_imported():
        return job_home(JobSpec.model_validate(spec))


def run_folder_of(spec: dict) -> str:
    """Where a job's checkpoints are, relative to its folder (a sweep's trials: the same for each)."""
    with refs_not_imported():
        return JobSpec.model_validate({k: v for k, v in spec.items() if k != "sweep"}).checkpoint.run_folder


def request_stop(spec: dict) -> None:
    """Ask the job to stop at its next check, with a final checkpoint: in its folder in storage,
    which it reads wherever its Ray is."""
    home = home_of(spec)
    StopFlag(home.key, (home.root, home.job)).request_in_storage()


def checkpoints_in(root: StorageRoot, path: str) -> list[dict[str, Any]]:
    """The checkpoints in a run folder (``path`` in ``root.fs``), oldest first, with their state."""
    return _checkpoint.list_checkpoints(root.fs, path)


def profiles(root: StorageRoot, job: str) -> list[str]:
    """URIs of a job's profiler traces."""
    from trainers.observe import profiles_of

    return profiles_of(root, job)


def start_local_ray(workers: int) -> bool:
    """Join the running Ray, else start a local one for `etrain serve`; True when this process started it
    (and ``release_local_ray`` must stop it)."""
    from cluster.ray_session import ensure_ray

    return ensure_ray(workers)


def release_local_ray(started: bool) -> None:
    from cluster.ray_session import release_ray

    release_ray(started)
