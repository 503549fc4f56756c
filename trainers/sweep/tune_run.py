"""Ray Tune wiring: the space as Tune's domains, the searcher and the scheduler, the signed state
Tune keeps, and the driver that runs (or resumes) a sweep to its results.json and best.yaml."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import yaml

from cluster.storage import StorageRoot
from trainers.config.errors import SpecError
from trainers.job_folder import SWEEP_RESULTS_FILE
from trainers.sweep.report import best_row, result_rows, settle_trial_summaries
from trainers.sweep.spec import TIME_ATTR, SweepConfig, SweepPlan, trial_spec_data
from trainers.sweep.trials import remove_trial_placement_group, run_trial, trial_cleanup_callback

log = logging.getLogger(__name__)

TRIAL_DRIVER_CPU = 0.05


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


def trials_base(plan: SweepPlan) -> dict:
    """The base spec the trials get: a relative ``model.init_from`` read from the directory the
    sweep is launched in (each trial runs in a directory of its own)."""
    from trainers.init_weights import absolute

    model = plan.base.get("model")
    if not (isinstance(model, dict) and isinstance(model.get("init_from"), str)):
        return plan.base
    return {**plan.base, "model": {**model, "init_from": absolute(model["init_from"])}}


def run_sweep(plan: SweepPlan, resume: bool = False) -> tuple[int, dict]:
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
            log.warning("%d trials x %d workers need %d CPUs, the cluster has %.0f: trials will wait "
                        "for workers", s.max_concurrent_trials, d.max_workers, fits, cpus)
        data_uri = prepare_data(plan.spec, jobs)  # once, before trials race to make it
        trainable = tune.with_resources(
            tune.with_parameters(run_trial, base=trials_base(plan), space=s.space, jobs_uri=jobs.uri, data_uri=data_uri),
            # A trial's driver only waits on its TorchTrainer, whose workers hold the real resources
            # (Tune refuses an empty request).
            {"cpu": TRIAL_DRIVER_CPU})
        if resume:
            log.info("resuming sweep %r from %s", plan.name, root.uri_of(sweep_dir, "tune"))
            tuner = tune.Tuner.restore(tune_path + "/tune", trainable, resume_unfinished=True, resume_errored=True,
                                       storage_filesystem=tune_fs)
        else:
            log.info("sweep %r: %d sample(s), %s search, %s scheduler, %s (%s), %d at a time; storage %s",
                     plan.name, s.samples, s.search, s.scheduler, s.metric, s.mode, s.max_concurrent_trials,
                     root.uri_of(sweep_dir))
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
            remove_trial_placement_group(jobs, row["trial"])
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
        root.write_json(report, sweep_dir, SWEEP_RESULTS_FILE)
    finally:
        release_ray(started_ray)
    errors = [r for r in rows if r["status"] == "error"]
    return (EXIT_FAILED if errors or not best else EXIT_OK), report
