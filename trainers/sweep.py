"""Hyperparameter sweeps: Ray Tune searches a space of job specs, and every trial is a full job.

A sweep file is a job spec with a ``sweep`` section (or a ``sweep`` section whose ``base``
names a job spec file). Each trial is that spec with the trial's values set, run by the same
``run_job`` as a single job: elastic, spot-tolerant, checkpointed, with the job's global
batch semantics. Ray Train reports to Tune through ``TuneReportCallback`` at checkpoints: a
trial reports every one (``checkpoint.report_interval_s`` 0 unless the sweep file sets it), since
the scheduler decides at reports.

Layout under the storage root::

    <root>/sweeps/<name>/tune/            Ray Tune's experiment state (what --resume reads)
    <root>/sweeps/<name>/jobs/<trial>/    each trial's job folder: checkpoints, summary.json
    <root>/sweeps/<name>/results.json     every trial: values, status, metrics
    <root>/sweeps/<name>/best.yaml        the best trial's job spec, ready for `etrain run`

Run it: ``python -m trainers.sweep SPEC`` or ``etrain sweep SPEC [--resume]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError

from cluster.storage import StorageRoot
from trainers.config import (JobSpec, SpecError, Strict, WorkerRange, add_digest_arg, apply_overrides, default_name,
                             format_errors, key_problem, read_spec_file, validate)

DOMAINS = {
    "choice": "pick one of the listed values",
    "grid": "try every listed value",
    "uniform": "a float between [low, high]",
    "loguniform": "a float between [low, high], uniform in log space (learning rates)",
    "randint": "a whole number between [low, high], both included",
}
RANGE_DOMAINS = ("uniform", "loguniform", "randint")
# What the training loop reports at its checkpoints, and so what a sweep can optimise.
METRICS = ("loss", "samples_per_s", "steady_samples_per_s", "tokens_per_s", "train_seconds")
# Trials are compared at equal data seen, so batch sizes compete on the same number of samples.
TIME_ATTR = "epochs_done"
# Every listed value is checked in its trial's job spec before a sweep is accepted, at a cost that
# grows with the spec: the values a space lists in all are bounded, so that check stays short (a
# search needs far fewer; a range samples from many).
MAX_SPACE_VALUES = 256
TRIAL_DRIVER_CPU = 0.05


class SweepConfig(Strict):
    base: str | None = Field(None, description="job spec file to vary (relative to the sweep file); "
                                               "default: the rest of the sweep file")
    space: dict[str, dict[str, Any]] = Field(description="dotted spec key -> {choice|grid|uniform|loguniform|randint: ...}")
    metric: Literal[METRICS] = "loss"  # type: ignore[valid-type]
    mode: Literal["min", "max"] = "min"
    search: Literal["random", "grid", "optuna"] = "random"
    scheduler: Literal["asha", "median", "fifo"] = "asha"
    num_samples: int | None = Field(None, gt=0, description="trials to sample (default 8); with search: grid, "
                                                            "repeats of the whole grid (default 1)")
    max_concurrent_trials: int = Field(2, gt=0)
    workers_per_trial: int | WorkerRange | None = Field(None, description="default: the job's distributed.num_workers")
    grace_period_epochs: float = Field(0.25, gt=0, description="ASHA/median: data every trial sees before it may stop")
    reduction_factor: float = Field(2.0, gt=1, description="ASHA: keep 1/reduction_factor of the trials at each rung")
    seed: int = Field(0, ge=0, description="seed of the search, so the same sweep samples the same trials")


    @property
    def samples(self) -> int:
        return self.num_samples or (1 if self.search == "grid" else 8)


@dataclass(frozen=True)
class SweepPlan:
    """A checked sweep: the base job spec (as data and as a model) and the sweep settings."""

    name: str
    base: dict
    spec: JobSpec
    sweep: SweepConfig


def set_dotted(data: dict, key: str, value: Any) -> dict:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value
    return data


def trial_spec_data(base: dict, values: dict[str, Any]) -> dict:
    """The base spec with one trial's values set (the base is not changed).

    An absolute checkpoint.path would put every trial in one folder: a trial's stay in its own.
    """
    data = copy.deepcopy(base)
    for key, value in values.items():
        set_dotted(data, key, value)
    checkpoint = data.get("checkpoint")
    if isinstance(checkpoint, dict) and isinstance(checkpoint.get("path"), str):
        checkpoint["path"] = checkpoint["path"].lstrip("/")
    return data


def trial_spec_view(base: dict, key: str, value: Any) -> dict:
    """The base with one value set, sharing every part the key does not pass through: for checks
    that only read it (cheap for every listed value of a space, where a deep copy each is not)."""
    top = dict(base)
    node = top
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        node[part] = dict(child) if isinstance(child, dict) else {}
        node = node[part]
    node[parts[-1]] = value
    return top


def domain_problems(key: str, domain: Any, search: str) -> list[str]:
    """Shape checks of one space entry: one known domain, sensible bounds, fits the searcher."""
    path = f"sweep.space.{key}"
    example = "e.g. {loguniform: [1.0e-4, 1.0e-1]} or {choice: [32, 64]}"
    if not isinstance(domain, dict) or len(domain) != 1 or next(iter(domain)) not in DOMAINS:
        return [f"{path}: {json.dumps(domain, default=str)}: expected exactly one of {', '.join(DOMAINS)}: {example}"]
    kind, arg = next(iter(domain.items()))
    path = f"{path}.{kind}"
    if kind in ("choice", "grid"):
        if not isinstance(arg, list):
            return [f"{path}: {json.dumps(arg, default=str)}: not a list: write the values as a list, e.g. [32, 64]"]
        if not arg:
            return [f"{path}: []: empty: list at least one value"]
        if kind == "grid" and search == "optuna":
            return [f"{path}: grid: optuna samples, it does not enumerate: use choice, or search: grid"]
        return []
    if not (isinstance(arg, list) and len(arg) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                             for v in arg)):
        return [f"{path}: {json.dumps(arg, default=str)}: expected [low, high] numbers, e.g. [0.0001, 0.1]"]
    low, high = arg
    if low > high:
        return [f"{path}: [{low}, {high}]: low > high: swap them"]
    if kind == "loguniform" and low <= 0:
        return [f"{path}: [{low}, {high}]: log-uniform needs low > 0: use a positive lower bound such as 1e-6"]
    if kind == "randint" and not (float(low).is_integer() and float(high).is_integer()):
        return [f"{path}: [{low}, {high}]: randint needs whole numbers: use uniform for floats"]
    if search == "grid":
        return [f"{path}: a range cannot be enumerated by search: grid: list the values with grid/choice, "
                "or use search: random"]
    return []


def tune_expression_at(value: Any, path: str) -> str | None:
    """Where ``value`` holds a mapping keyed like a Ray Tune expression (``eval``, ``grid_search``),
    as a problem line, or None. Walked without recursion, at any depth."""
    from cluster.ray_adapter.tune import TUNE_EXPRESSION_KEYS

    stack = [(value, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            found = [k for k in TUNE_EXPRESSION_KEYS if k in node]
            if found:
                return (f"{where}: a mapping with the key {found[0]!r}: Ray Tune would read it as "
                        f"{'Python to run' if found[0] == 'eval' else 'more trials'}: listed values are data; "
                        "rename the key, or list the values you want under this key's own domain")
            stack.extend((child, f"{where}.{key}") for key, child in node.items())
        elif isinstance(node, list):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(node))
    return None


def candidate_values(domain: dict) -> list[Any]:
    """Values that stand for a domain when checking it against the job spec: all listed, or both bounds."""
    kind, arg = next(iter(domain.items()))
    if kind == "randint":
        return [int(arg[0]), int(arg[1])]
    return list(arg)


def space_problems(sweep: SweepConfig, base: dict) -> list[str]:
    """Every problem of the search space at once, each naming ``sweep.space.<key>``."""
    problems, listed = [], 0
    if not sweep.space:
        return ["sweep.space: {}: empty: name at least one key to vary, e.g. training.learning_rate: "
                "{loguniform: [1.0e-4, 1.0e-1]}"]
    for key, domain in sweep.space.items():
        path = f"sweep.space.{key}"
        if key in ("name", "checkpoint", "checkpoint.storage_root"):
            problems.append(f"{path}: not searchable: a sweep names and stores its trials itself")
            continue
        if key == "labels" or key.startswith("labels."):
            problems.append(f"{path}: not searchable: labels (the tenant's among them) hold for the whole sweep")
            continue
        unknown = key_problem(key)
        if unknown:
            problems.append(f"{path}: unknown key: {unknown}")
            continue
        shape = domain_problems(key, domain, sweep.search)
        if shape:
            problems.extend(shape)
            continue
        expression = tune_expression_at(next(iter(domain.values())), f"{path}.{next(iter(domain))}")
        if expression:
            problems.append(expression)
            continue
        kind, values = next(iter(domain)), candidate_values(domain)
        listed += len(values)
        if listed > MAX_SPACE_VALUES:
            problems.append(f"{path}.{kind}: {len(values)} values, {listed} in the space so far: a space lists at most "
                            f"{MAX_SPACE_VALUES} values in all (a range counts its two ends): list fewer, or sample "
                            "a range (uniform, loguniform, randint)")
            break
        for value in values:
            try:
                validate(trial_spec_view(base, key, value))
            except SpecError as exc:
                problems.append(f"{path}: {json.dumps(value)} makes the job spec invalid: {exc.problems[0]}")
                break
    return problems


def load_sweep(path: str | Path, overrides: list[str] | None = None, sha256: str | None = None) -> SweepPlan:
    """Read a sweep file (and its base), apply ``--set`` overrides to the job part, check it all.
    With ``sha256``, the file's bytes must have that digest (trainers.config.read_spec_file)."""
    return plan_from_data(read_spec_file(path, sha256), str(path), overrides)


def plan_from_data(data: dict, path: str, overrides: list[str] | None = None) -> SweepPlan:
    """Check a parsed sweep file; ``path`` names it in errors and anchors a relative ``base``."""
    data = copy.deepcopy(data)
    raw = data.pop("sweep", None)
    if raw is None:
        raise SpecError([f"{path}: no 'sweep' section: add one (see configs/sweep.yaml), or use `etrain run` for a job"])
    if not isinstance(raw, dict):
        raise SpecError([f"sweep: {json.dumps(raw, default=str)}: not a mapping: write the sweep settings as keys"])
    try:
        sweep = SweepConfig.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(format_errors(exc, SweepConfig, "sweep")) from None
    name = data.get("name") or default_name(Path(str(path)).stem)
    if sweep.base:
        base_path = sweep.base if "://" in sweep.base else str(Path(str(path)).parent / sweep.base)
        base = read_spec_file(base_path)
        base = _merge(base, data)
    else:
        base = data
    base = apply_overrides(base, overrides or [])
    base["name"] = name
    if sweep.workers_per_trial is not None:
        workers = sweep.workers_per_trial
        base.setdefault("distributed", {})["num_workers"] = workers if isinstance(workers, int) else workers.model_dump()
    spec = validate(base)
    problems = space_problems(sweep, base)
    if problems:
        raise SpecError(problems)
    return SweepPlan(name=name, base=base, spec=spec, sweep=sweep)


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# ---------------------------------------------------------------- Tune


def tune_space(sweep: SweepConfig) -> dict[str, Any]:
    """The space as Ray Tune domains, keyed by dotted spec key.

    A listed value reaches Tune as its index, never as itself: Tune's variant generator reads a
    one-key mapping ``{"eval": ...}`` inside a value as Python to run and ``{"grid_search": [...]}``
    as more trials, at any depth. Indices are plain ints; ``trial_values`` maps them back in the
    trial. Ranges reach it as the two numbers they are.
    """
    from ray import tune

    space = {}
    for key, domain in sweep.space.items():
        kind, arg = next(iter(domain.items()))
        if kind == "grid" or (kind == "choice" and sweep.search == "grid"):
            space[key] = tune.grid_search(list(range(len(arg))))
        elif kind == "choice":
            space[key] = tune.choice(list(range(len(arg))))
        elif kind == "uniform":
            space[key] = tune.uniform(*arg)
        elif kind == "loguniform":
            space[key] = tune.loguniform(*arg)
        else:
            space[key] = tune.randint(int(arg[0]), int(arg[1]) + 1)  # Tune's upper bound is exclusive
    return space


def trial_values(space: dict[str, dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    """A trial's values from Tune's config: a listed domain's index becomes the value it lists."""
    values = {}
    for key, picked in config.items():
        domain = space.get(key)
        kind, arg = next(iter(domain.items())) if isinstance(domain, dict) and len(domain) == 1 else (None, None)
        values[key] = copy.deepcopy(arg[picked]) if kind in ("choice", "grid") else picked
    return values


def make_scheduler(sweep: SweepConfig):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, MedianStoppingRule

    if sweep.scheduler == "asha":
        # No max_t from us: every trial ends at its own target; ASHA only stops the laggards.
        return ASHAScheduler(time_attr=TIME_ATTR, max_t=1e6, grace_period=sweep.grace_period_epochs,
                             reduction_factor=sweep.reduction_factor)
    if sweep.scheduler == "median":
        return MedianStoppingRule(time_attr=TIME_ATTR, grace_period=sweep.grace_period_epochs, min_samples_required=3)
    return FIFOScheduler()


def make_searcher(sweep: SweepConfig):
    """Tune's searcher; the concurrency cap goes here (Tune ignores TuneConfig's for a generator)."""
    from ray.tune.search import ConcurrencyLimiter
    from ray.tune.search.basic_variant import BasicVariantGenerator

    if sweep.search == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        return ConcurrencyLimiter(OptunaSearch(seed=sweep.seed), max_concurrent=sweep.max_concurrent_trials)
    return BasicVariantGenerator(random_state=sweep.seed, max_concurrent=sweep.max_concurrent_trials)


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

    from trainers.home import job_home
    from trainers.launch import latest_metrics, run_job

    values = trial_values(space, config)
    spec = validate(trial_job_data(base, values, trial_job_name(ray.tune.get_context().get_trial_id()), jobs_uri))
    done, _, _ = latest_metrics(job_home(spec))
    if done and done.get("step") == done.get("target_step"):
        ray.tune.report(done)  # finished before the sweep's driver died: report, do not train again
        return
    _, summary = run_job(spec, callbacks=(TuneReportCallback(),), data_uri=data_uri)
    if summary["status"] == "failed":
        raise RuntimeError(f"trial job {spec.name} failed: {summary['error']}")


def trial_job_key(jobs: StorageRoot, trial_id: str) -> str:
    """The key a trial's job runs under in Ray, as the trial derives it (trainers.home: it depends
    on the job's folder alone, ``trial_job_data`` fixes that folder under ``jobs``)."""
    from trainers.home import JobHome

    return JobHome(jobs, trial_job_name(trial_id), "").key


def remove_trial_placement_group(jobs: StorageRoot, trial_id: str, say=print) -> None:
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
        say(f"[etrain] note: could not remove trial {trial_id}'s placement group ({type(exc).__name__}: {exc})")


def trial_cleanup_callback(jobs: StorageRoot):
    """A Tune callback that removes an ended trial's placement group once the trial's actor is gone.

    Tune tells callbacks a trial ended before it ends the actor. Removed then, the group's loss
    would look like a lost node to the trial's own driver, which would start a new group (and
    record it after the removal). So each ended trial's actor is asked whether it is still there
    (one small call a second, Ray's public API) and its group removed when it is not; whatever is
    left when the sweep ends, then. A trial that finished by itself has removed its own already.
    It holds no ``say``: Tune pickles its callbacks with the sweep, and a caller's printer (a
    replaced ``print``) may not pickle."""
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


def settle_trial_summaries(rows: list[dict], base: dict, jobs: StorageRoot) -> None:
    """Give every trial stopped by the scheduler a summary that says so.

    Tune stops a trial by tearing its training down, often before the trial's own summary is
    written (or after it recorded the teardown as a failure). Its checkpoints say where it got.
    A trial reports in the background while it trains on, so it may reach its target before
    the scheduler's stop arrives: its row then says it finished, where and with what loss.
    """
    from trainers.home import job_home
    from trainers.launch import latest_metrics, make_summary

    for row in rows:
        if row["status"] == "error":
            continue
        name = trial_job_name(row["trial"])
        summary = jobs.read_json(name, "summary.json") if jobs.exists(name, "summary.json") else {}
        if not summary or summary.get("status") == "failed":
            spec = validate(trial_job_data(base, row["params"], name, jobs.uri))
            metrics, path, _ = latest_metrics(job_home(spec))
            summary = make_summary(spec, job_home(spec), metrics, path, None, row["time_s"])
            if not reached_target(summary):  # torn down after its target, the job was done
                summary.update(status="stopped", stopped_by="sweep scheduler")
            jobs.write_json(summary, name, "summary.json")
        if reached_target(summary) and row["status"] == "stopped early":
            row.update(status="finished", step=summary["final_step"], target_step=summary["target_step"],
                       loss=summary["final_loss"],  # the metric too, when it is the loss (the row's key)
                       scheduler_stop="came after the job reached its target")


def reached_target(summary: dict) -> bool:
    """A trial's job that got to its target step (its checkpoints say so), however it ended."""
    final, target = summary.get("final_step"), summary.get("target_step")
    return summary.get("status") == "succeeded" and final is not None and target is not None and final >= target


def tune_filesystem(root: StorageRoot, tune_path: str):
    """The filesystem Tune keeps the sweep's state through. Given a key (``$ETRAIN_STATE_KEY``: the
    service gives each sweep one, kept in its own state), every file Tune writes is signed and every
    file it reads back is checked first: Tune unpickles its state on resume, and a tenant's keys can
    write the storage it lies in (cluster.signed_fs). Without one (`etrain sweep` by the owner of
    the storage), the storage's own."""
    from cluster.signed_fs import KEY_ENV, key_from_hex, signed_filesystem

    key = os.environ.get(KEY_ENV)
    return signed_filesystem(root.fs, tune_path, key_from_hex(key)) if key else root.fs


def verify_tune_state(fs, experiment: str) -> None:
    """Check every state file Tune will read before Tune reads it: Tune's controller catches a failed
    resume and starts the sweep over, so a refused file must stop the resume here, loudly."""
    from cluster.signed_fs import UnverifiedFileError, verify_folder

    try:
        verify_folder(fs, experiment)
    except UnverifiedFileError as exc:
        raise SpecError([f"--resume: the sweep's saved state does not verify ({exc}): it is not read; start the "
                         "sweep anew under another name"]) from None


def run_sweep(plan: SweepPlan, resume: bool = False, say=print) -> tuple[int, dict]:
    """Run (or resume) a sweep to the end; write results.json and best.yaml; return (exit code, report)."""
    import ray
    from ray import tune

    from cluster.ray_adapter.tune import checkpoint_experiment_every
    from cluster.ray_session import ensure_ray, release_ray
    from trainers.launch import EXIT_FAILED, EXIT_OK, preflight
    from trainers.workloads.datasets import prepare_data

    checkpoint_experiment_every(1)  # a killed driver loses at most 1 s of trial states
    started = time.time()
    root = preflight(plan.spec)
    sweep_dir = f"sweeps/{plan.name}"
    jobs = root.sub(sweep_dir, "jobs")
    tune_path = root.path(sweep_dir)
    exists = root.exists(sweep_dir, "tune")
    if exists and not resume:
        raise SpecError([f"name: {plan.name!r}: a sweep of this name exists at {root.uri_of(sweep_dir)}: "
                         "pass --resume to continue it, or set another name"])
    if resume and not exists:
        raise SpecError([f"--resume: no sweep {plan.name!r} at {root.uri_of(sweep_dir)}: run it without --resume first"])
    tune_fs = tune_filesystem(root, tune_path)
    if resume:
        verify_tune_state(tune_fs, tune_path + "/tune")
    s, d = plan.sweep, plan.spec.distributed
    started_ray = ensure_ray(s.max_concurrent_trials * d.max_workers)
    try:
        fits = s.max_concurrent_trials * d.max_workers
        cpus = ray.cluster_resources().get("CPU", 0)
        if not d.use_gpu and fits > cpus:
            say(f"[etrain] note: {s.max_concurrent_trials} trials x {d.max_workers} workers need {fits} CPUs, "
                f"the cluster has {cpus:.0f}: trials will wait for workers")
        data_uri = prepare_data(plan.spec, jobs)  # once, before trials race to make it
        trainable = tune.with_resources(
            tune.with_parameters(run_trial, base=plan.base, space=s.space, jobs_uri=jobs.uri, data_uri=data_uri),
            # A trial's driver only waits on its TorchTrainer, whose workers hold the real resources
            # (Tune refuses an empty request).
            {"cpu": TRIAL_DRIVER_CPU})
        if resume:
            say(f"[etrain] resuming sweep {plan.name!r} from {root.uri_of(sweep_dir, 'tune')}")
            tuner = tune.Tuner.restore(tune_path + "/tune", trainable, resume_unfinished=True, resume_errored=True,
                                       storage_filesystem=tune_fs)
        else:
            say(f"[etrain] sweep {plan.name!r}: {s.samples} sample(s), {s.search} search, {s.scheduler} "
                f"scheduler, {s.metric} ({s.mode}), {s.max_concurrent_trials} at a time; "
                f"storage {root.uri_of(sweep_dir)}")
            tuner = tune.Tuner(
                trainable, param_space=tune_space(s),
                tune_config=tune.TuneConfig(metric=s.metric, mode=s.mode, num_samples=s.samples,
                                            search_alg=make_searcher(s), scheduler=make_scheduler(s)),
                run_config=tune.RunConfig(name="tune", storage_path=tune_path, storage_filesystem=tune_fs,
                                          callbacks=[trial_cleanup_callback(jobs)],
                                          failure_config=tune.FailureConfig(max_failures=0), verbose=1),
            )
        grid = tuner.fit()
        rows = result_rows(grid, s.metric, s.space)
        for row in rows:  # a resumed sweep started before this callback existed, or a callback's missed call
            remove_trial_placement_group(jobs, row["trial"], say)
        settle_trial_summaries(rows, plan.base, jobs)
        best = best_row(rows, s.metric, s.mode)
        report = {"name": plan.name, "metric": s.metric, "mode": s.mode, "scheduler": s.scheduler,
                  "started_at": started, "wall_time_s": round(time.time() - started, 2), "trials": rows, "best": best,
                  "storage": root.uri_of(sweep_dir)}
        if best:
            best_data = trial_spec_data(plan.base, best["params"])
            best_data["name"] = f"{plan.name}-best"
            best_data.setdefault("checkpoint", {})["storage_root"] = plan.spec.checkpoint.storage_root
            root.write_bytes(yaml.safe_dump(best_data, sort_keys=False).encode(), sweep_dir, "best.yaml")
            report["best_spec"] = root.uri_of(sweep_dir, "best.yaml")
        root.write_json(report, sweep_dir, "results.json")
    finally:
        release_ray(started_ray)
    errors = [r for r in rows if r["status"] == "error"]
    return (EXIT_FAILED if errors or not best else EXIT_OK), report


def result_rows(grid, metric: str, space: dict[str, dict[str, Any]]) -> list[dict]:
    """One row per trial: values, status (finished, stopped early, error), step reached, metrics."""
    rows = []
    for result in grid:
        m = result.metrics or {}
        trial_id = m.get("trial_id") or Path(result.path).name
        if result.error is not None:
            status = "error"
        elif m.get("step") is not None and m.get("target_step") and m["step"] < m["target_step"]:
            status = "stopped early"
        elif m.get("step") is None:
            status = "no result"
        else:
            status = "finished"
        rows.append({
            "trial": trial_id, "params": trial_values(space, result.config or {}),
            "status": status, "step": m.get("step"), "target_step": m.get("target_step"),
            "reports": m.get("training_iteration"), metric: m.get(metric),
            "loss": m.get("loss"), "samples_per_s": m.get("steady_samples_per_s"),
            "time_s": round(m.get("time_total_s") or 0.0, 2),
            "error": None if result.error is None else str(result.error).strip().splitlines()[-1][:300],
            "history": history(result, metric),
        })
    return sorted(rows, key=lambda r: r["trial"])


def history(result, metric: str) -> list[dict]:
    """Each report of a trial: when (Unix seconds), at which step, the metric and the loss (for curves)."""
    frame = result.metrics_dataframe
    if frame is None or frame.empty or "step" not in frame:
        return []
    cols = [c for c in dict.fromkeys(["timestamp", "step", TIME_ATTR, metric, "loss"]) if c in frame]
    return [{k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
            for row in frame[cols].to_dict("records")]


def best_row(rows: list[dict], metric: str, mode: str) -> dict | None:
    """The best trial by the final metric; a trial stopped early competes too (ASHA judged it)."""
    scored = [r for r in rows if r["status"] != "error" and isinstance(r.get(metric), (int, float))
              and not math.isnan(r[metric])]
    if not scored:
        return None
    pick = min if mode == "min" else max
    return pick(scored, key=lambda r: r[metric])


def render_table(report: dict) -> str:
    metric = report["metric"]
    keys = sorted({k for r in report["trials"] for k in r["params"]})
    head = ["trial", *keys, "status", "step", metric, "samples/s", "time_s"]
    lines = [head]
    for r in report["trials"]:
        lines.append([r["trial"], *(_fmt(r["params"].get(k)) for k in keys), r["status"],
                      f"{r['step']}/{r['target_step']}", _fmt(r.get(metric)), _fmt(r.get("samples_per_s")),
                      _fmt(r["time_s"])])
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def print_report(report: dict) -> None:
    print(f"\n[etrain] sweep {report['name']}: {len(report['trials'])} trials in {report['wall_time_s']:.1f}s "
          f"({report['scheduler']} scheduler)")
    print(render_table(report))
    best = report.get("best")
    if best:
        print(f"[etrain] best: {best['trial']} {report['metric']}={_fmt(best[report['metric']])} with "
              + ", ".join(f"{k}={_fmt(v)}" for k, v in best["params"].items()))
        print(f"[etrain] best spec: {report['best_spec']}  (run it: etrain run {report['best_spec']})")
    else:
        print("[etrain] no trial reported the metric: see the errors above")
    print(f"[etrain] results:   {report['storage']}/results.json")


EXAMPLES = """examples:
  etrain sweep configs/sweep.yaml
  etrain sweep configs/sweep.yaml --resume          # after the driver died or was stopped
  etrain sweep configs/sweep.yaml --set training.max_steps=40

A sweep file is a job spec plus a 'sweep' section (see configs/sweep.yaml). Every trial is a
full job: elastic, checkpointed, resumable. Exit codes: 0 done with a best trial, 1 a trial
failed or none reported the metric, 2 invalid sweep.
"""


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="sweep file: a job spec with a 'sweep' section (JSON or YAML)")
    p.add_argument("--resume", action="store_true",
                   help="continue a sweep whose driver stopped: finished trials are kept, unfinished ones "
                        "continue from their checkpoints")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the base job spec (repeatable; values read as YAML)")
    p.add_argument("--json", action="store_true", help="print the final report as JSON only")
    add_digest_arg(p)


def cmd_sweep(args: argparse.Namespace) -> int:
    try:
        plan = load_sweep(args.spec, args.overrides, args.spec_sha256)
        say = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
        code, report = run_sweep(plan, resume=args.resume, say=say)
    except SpecError as exc:
        print(exc.render(f"sweep {args.spec}"), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainers.sweep", description=__doc__.split("\n\n")[0],
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_args(parser)
    return cmd_sweep(parser.parse_args(argv))


if __name__ == "__main__":
    # Run as trainers.sweep, not as __main__: Tune pickles the trainable and the callbacks with the
    # sweep, and cloudpickle copies __main__'s functions by value, defaults and all. A default
    # ``print`` then fails to pickle once Ray's driver has replaced print (tqdm_ray does, when its
    # workers' first logs arrive); the importable module's functions are pickled by name.
    from trainers.sweep import main as module_main

    sys.exit(module_main())
