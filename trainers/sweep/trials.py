"""One trial as Tune runs it: the base job spec with the trial's values, run as a job under the
sweep; and the removal of the placement group a stopped trial's training leaves behind.

Everything here is pickled by Tune with the sweep (the trainable and the callback): it lives in
an importable module, so cloudpickle copies it by name, never by value as it would ``__main__``'s.
"""

from __future__ import annotations

import copy
import logging
import sys
import time
from typing import Any

from cluster.log_lines import send_to
from cluster.storage import StorageRoot
from trainers.config.loading import validate
from trainers.sweep.spec import trial_spec_data

log = logging.getLogger(__name__)


def trial_values(space: dict[str, dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    """A trial's values from Tune's config: a listed domain's index becomes the value it lists."""
    values = {}
    for key, picked in config.items():
        domain = space.get(key)
        kind, arg = next(iter(domain.items())) if isinstance(domain, dict) and len(domain) == 1 else (None, None)
        values[key] = copy.deepcopy(arg[picked]) if kind in ("choice", "grid") else picked
    return values


def trial_job_name(trial_id: str) -> str:
    return f"trial-{trial_id}".lower()


def trial_job_data(base: dict, values: dict[str, Any], name: str, jobs_uri: str) -> dict:
    """A trial's job spec: its values, its name and folder under the sweep, and a report to Tune at
    every checkpoint unless the sweep file sets ``checkpoint.report_interval_s`` (the scheduler
    decides at reports)."""
    data = trial_spec_data(base, values)
    data["name"] = name
    checkpoint = data.setdefault("checkpoint", {})
    checkpoint["storage_root"] = jobs_uri
    checkpoint.setdefault("report_interval_s", 0)
    return data


def run_trial(config: dict, base: dict, space: dict, jobs_uri: str, data_uri: str) -> None:
    """One trial, inside Tune: the base spec with this trial's values, run as a job."""
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from trainers.job_folder import job_home
    from trainers.launch import latest_metrics, run_job

    values = trial_values(space, config)
    spec = validate(trial_job_data(base, values, trial_job_name(ray.tune.get_context().get_trial_id()), jobs_uri))
    done, _, _ = latest_metrics(job_home(spec))
    if done and done.get("step") == done.get("target_step"):
        ray.tune.report(done)  # finished before the sweep's driver died: report, do not train again
        return
    restore = send_to(sys.stdout)  # a trial is a process of its own: Ray forwards its stdout to the sweep's driver
    try:
        _, summary = run_job(spec, callbacks=(TuneReportCallback(),), data_uri=data_uri)
    finally:
        restore()
    if summary["status"] == "failed":
        raise RuntimeError(f"trial job {spec.name} failed: {summary['error']}")


def trial_job_key(jobs: StorageRoot, trial_id: str) -> str:
    """The key a trial's job runs under in Ray, as the trial derives it (trainers.job_folder: it depends
    on the job's folder alone, ``trial_job_data`` fixes that folder under ``jobs``)."""
    from trainers.job_folder import JobHome

    return JobHome(jobs, trial_job_name(trial_id), "").key


def remove_trial_placement_group(jobs: StorageRoot, trial_id: str) -> None:
    """Remove the placement group a trial's training held, if it is still there.

    Tune stops a trial (its scheduler's early stop, an error) by ending the trial's actor: the
    training's controller, a child of it, goes too, but the workers' placement group belongs to the
    job and stays, holding their CPUs, until later trials could not start (bench/sweep.py hung
    so). The trial records it under its job's key (cluster.ray_adapter.train_callbacks.placement_group_record)."""
    from cluster.ray_adapter import train_callbacks

    try:
        train_callbacks.remove_recorded_placement_group(
            train_callbacks.placement_group_record(trial_job_key(jobs, trial_id)))
    except Exception as exc:  # boundary: a leftover only costs capacity; the sweep goes on
        log.warning("could not remove trial %s's placement group (%s: %s)", trial_id,
                    type(exc).__name__, exc)


def trial_cleanup_callback(jobs: StorageRoot):
    """A Tune callback that removes an ended trial's placement group once the trial's actor is gone.

    Tune tells callbacks a trial ended before it ends the actor. Removed then, the group's loss
    would look like a lost node to the trial's own driver, which would start a new group (and
    record it after the removal). So each ended trial's actor is asked whether it is still there
    (one small call a second, Ray's public API) and its group removed when it is not; whatever is
    left when the sweep ends, then. A trial that finished by itself has removed its own already.
    It tells through this module's logger, never a caller's printer: Tune pickles its callbacks
    with the sweep, and a printer (a replaced ``print``) may not pickle."""
    import ray
    from ray import tune

    from cluster.ray_adapter.tune import actor_ready, trial_actor

    class RemoveEndedTrialsPlacementGroups(tune.Callback):
        POLL_INTERVAL_S = 1.0

        def __init__(self):
            self.ending: dict[str, list] = {}  # trial id -> [its actor, the pending liveness call or None]
            self.polled_at = 0.0

        def on_trial_complete(self, iteration, trials, trial, **info):
            self._ended(trial)

        def on_trial_error(self, iteration, trials, trial, **info):
            self._ended(trial)

        def _ended(self, trial) -> None:
            actor = trial_actor(trial)
            if actor is None:
                remove_trial_placement_group(jobs, trial.trial_id)
            else:
                self.ending[trial.trial_id] = [actor, None]

        def on_step_begin(self, iteration, trials, **info):
            if not self.ending or time.monotonic() - self.polled_at < self.POLL_INTERVAL_S:
                return
            self.polled_at = time.monotonic()
            for trial_id, entry in list(self.ending.items()):
                actor, call = entry
                if call is None:
                    entry[1] = actor_ready(actor)
                    continue
                if not ray.wait([call], timeout=0)[0]:
                    continue
                try:
                    ray.get(call)
                    entry[1] = None  # still there: ask again
                except Exception:  # boundary: gone (RayActorError), or past asking: the trial has ended either way
                    del self.ending[trial_id]
                    remove_trial_placement_group(jobs, trial_id)

        def on_experiment_end(self, trials, **info):
            for trial_id in list(self.ending):
                del self.ending[trial_id]
                remove_trial_placement_group(jobs, trial_id)

    return RemoveEndedTrialsPlacementGroups()
