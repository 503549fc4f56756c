"""JobSpec -> TorchTrainer(ScalingConfig, FailureConfig, RunConfig), run it, write the summary.

Layout under the storage root, per job name (same name + root = resume that job)::

    <root>/<name>/summary.json                 the run summary (also printed)
    <root>/<name>/<checkpoint folder>/         Ray Train's run folder: checkpoint_<step>/ ...
    <root>/datasets/                           built-in data converted to Parquet on first use

An absolute ``checkpoint.path`` moves the job's folder there (see trainers.job_folder).
"""

from __future__ import annotations

import logging
import os
import posixpath
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field

import pyarrow.fs as pafs
import ray
from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig

from cluster.capacity import gpu_capacity
from cluster.ray_adapter import train_torch
from cluster.ray_adapter.train_worker import WORKER_ENV
from cluster.ray_session import NodeWatch, ensure_ray, node_liveness, release_ray, settle_cluster_view
from cluster.storage import StorageRoot, open_root
from trainers import checkpoint_files as ckpt
from trainers.config.errors import SpecError
from trainers.config.job import JobSpec
from trainers.init_weights import InitFromError, absolute, check_exists
from trainers.job_folder import (JOB_FILE, RAY_SNAPSHOT_FILE, SUMMARY_FILE, JobHome, job_home,
                                 read_interruptions)
from trainers.recovery import StopFlag, classify_failure, nodes_died, settle_peer_lost, should_retry
from trainers.worker_log import LOG_LEVEL_ENV
from trainers.workloads.datasets import prepare_data

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_STOPPED = 0, 1, 2, 3
CONTROLLER_POLL_INTERVAL_S = 0.5
# How long a failure that only lost a peer waits for Ray to declare a node dead (its health check:
# 3 s x 5 misses by default) before it is the user's.
PEER_LOSS_WAIT_S = 30.0


@dataclass(frozen=True)
class Runtime:
    """What the spec means on this cluster: decided once, by a pure function."""

    use_gpu: bool
    backend: str
    mixed_precision: str
    notes: list[str] = field(default_factory=list)


def resolve_runtime(spec: JobSpec, cluster_gpus: float, launchable_gpus: float = 0.0) -> Runtime:
    """Fit the spec to the cluster: GPU or not, NCCL or gloo, which autocast; raise what cannot be.

    ``launchable_gpus`` are GPUs the autoscaler can add (node types that scale from zero):
    they count as GPUs, so asking for them is what makes a GPU node launch.
    """
    d, notes, problems = spec.distributed, [], []
    can_have_gpus = cluster_gpus > 0 or launchable_gpus > 0
    use_gpu = d.use_gpu if d.use_gpu is not None else can_have_gpus
    if use_gpu and not can_have_gpus:
        problems.append("distributed.use_gpu: true: the cluster has no GPUs and no GPU node type to launch: "
                        "set it to false or add GPU nodes (available_node_types with GPUs in ray_cluster.yaml)")
    if use_gpu and cluster_gpus <= 0 < launchable_gpus:
        notes.append(f"no GPU node is up yet: the job asks for GPUs and the autoscaler launches them "
                     f"(up to {launchable_gpus:g})")
    backend = d.backend if d.backend != "auto" else ("nccl" if use_gpu else "gloo")
    if backend == "nccl" and not use_gpu:
        notes.append("distributed.backend: nccl needs GPUs and none are used here: falling back to gloo")
        backend = "gloo"
    precision = spec.training.mixed_precision
    if precision == "fp16" and not use_gpu:
        problems.append("training.mixed_precision: fp16: needs a GPU (GradScaler): use bf16 on CPU")
    if d.master_addr or d.master_port:
        notes.append(f"distributed.master_addr/master_port ({d.master_addr}:{d.master_port}): "
                     "handled by Ray's rendezvous; the values are not used")
    if problems:
        raise SpecError(problems)
    return Runtime(use_gpu=use_gpu, backend=backend, mixed_precision=precision, notes=notes)


def preflight(spec: JobSpec) -> StorageRoot:
    """Checks that need the outside world but no Ray: the storage root and user data exist."""
    root = open_root(spec.checkpoint.storage_root)
    src = spec.data.source
    if src and not src.startswith("builtin:"):
        data_root = open_root(src.rsplit("/", 1)[0] or "/")
        if not data_root.exists(src.rsplit("/", 1)[1] or "."):
            raise SpecError([f"data.source: {src!r}: not found: check the path or the bucket"])
    if spec.model.init_from:
        try:
            check_exists(spec.model.init_from)
        except InitFromError as exc:
            raise SpecError([str(exc)]) from None
    return root


def with_absolute_paths(spec: JobSpec) -> JobSpec:
    """The spec the workers get: a relative ``model.init_from`` read from the directory the job
    is launched in (a worker's own directory is elsewhere)."""
    if not spec.model.init_from or absolute(spec.model.init_from) == spec.model.init_from:
        return spec
    return spec.model_copy(update={"model": spec.model.model_copy(update={"init_from": absolute(spec.model.init_from)})})


def build_trainer(spec: JobSpec, home: JobHome, runtime: Runtime, data_uri: str,
                  stop_at_step: int | None, run_id: str = "", previous_failure: str | None = None,
                  callbacks: tuple = (), submitted_at: float | None = None):
    from trainers.worker_entry import train_loop_per_worker

    storage_path, run_name = home.ray_paths()
    d = spec.distributed
    # The controller polls its workers every CONTROLLER_POLL_INTERVAL_S: it sees a finished or failed
    # group within 0.5 s instead of Ray's 2 s (each poll is one small call per worker), and it takes
    # one report per poll while report() waits for it (a sweep's trials report at every checkpoint).
    train_torch.set_controller_knobs(spec.fault_tolerance.worker_start_timeout_s, CONTROLLER_POLL_INTERVAL_S)
    num_workers = d.num_workers if isinstance(d.num_workers, int) else (d.num_workers.min, d.num_workers.max)
    loop = train_loop_per_worker
    if spec.train_loop:
        from trainers.workloads.custom import load_ref

        loop = load_ref(spec.train_loop)
    return train_torch.torch_trainer(
        loop,
        # Only a sweep passes callbacks (Tune's). Tune stops a trial by ending its actor, and this
        # driver with it: the sweep's driver removes the workers' placement group, found by the job.
        placement_group_key=home.key if callbacks else None,
        resize_checkpoint_timeout_s=d.resize_checkpoint_timeout_s,
        train_loop_config={
            "spec": spec.model_dump(mode="json"), "data_uri": data_uri, "storage_uri": home.root.uri,
            "job_dir": home.job, "job_key": home.key, "run_path": home.run_path, "stop_at_step": stop_at_step,
            "mixed_precision": runtime.mixed_precision,
            "run_id": run_id, "previous_failure": previous_failure, "attempt_started_at": time.time(),
            "submitted_at": submitted_at,
        },
        torch_config=train_torch.torch_config(backend=runtime.backend, timeout_s=d.timeout_s),
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=runtime.use_gpu,
                                     resources_per_worker=d.resources_per_worker,
                                     elastic_resize_monitor_interval_s=d.resize_check_interval_s),
        run_config=RunConfig(
            name=run_name, storage_path=storage_path, storage_filesystem=home.root.fs, callbacks=list(callbacks),
            # Every failure comes back to run_attempts, which knows a lost node from a user error
            # (Ray would charge both to max_failures). Preemptions too: before the next attempt
            # it waits for the drained node to leave and refreshes Ray Train's node list
            # (settle_cluster_view), which Ray's in-place restart would read up to 20 s stale.
            failure_config=FailureConfig(max_failures=0, max_preemption_failures=0),
            # Retention is ours (newest N plus the best by a metric, never a partial one): Ray keeps all.
            checkpoint_config=CheckpointConfig(num_to_keep=None),
            logging_config=LoggingConfig(log_level="WARNING"),  # our loop prints progress itself
            worker_runtime_env={"env_vars": WORKER_ENV | {LOG_LEVEL_ENV: os.environ.get(LOG_LEVEL_ENV, "INFO")}},
        ),
    )


def run_job(spec: JobSpec, stop_at_step: int | None = None, callbacks: tuple = (),
            data_uri: str | None = None) -> tuple[int, dict]:
    """Run a job to its target (or ``stop_at_step``); return (exit code, summary).

    Failures are retried here by kind (see trainers.recovery): a lost node never uses up the
    user's ``max_failures``; every attempt resumes from the newest verified checkpoint.
    ``callbacks`` go to Ray Train (a sweep passes Tune's); ``data_uri`` skips preparing the
    data when the caller already did (a sweep prepares once for all its trials).
    """
    started = time.time()
    root = preflight(spec)
    spec = with_absolute_paths(spec)
    home = job_home(spec)
    if not callbacks and not spec.train_loop and stop_at_step is None and spec.training.max_steps:
        metrics, checkpoint_uri, _ = latest_metrics(home)
        if reached_max_steps(metrics, spec.training.max_steps):
            log.info(f"job {spec.name!r} is done: its newest verified checkpoint is at step {metrics['step']}, "
                     f"its target (raise training.max_steps to train on): {checkpoint_uri}")
            return EXIT_OK, write_summary(spec, home, metrics, checkpoint_uri, None, started, interruptions=[])
    started_ray = ensure_ray(spec.distributed.max_workers)
    run_id = uuid.uuid4().hex[:12]
    stop_flag = StopFlag(home.key, (home.root, home.job))
    stop_flag.clear()  # a stop asked of an earlier run must not stop this one
    restore_signals = stop_on_signals(stop_flag)
    try:
        capacity = gpu_capacity(ray.cluster_resources().get("GPU", 0))
        runtime = resolve_runtime(spec, capacity.now, capacity.launchable)
        for note in runtime.notes:
            log.warning(f"{note}")
        data_uri = data_uri or prepare_data(spec, root)
        submitted_at = first_submitted_at(home, started)
        log.info(f"job {spec.name!r}: storage {home.uri}, checkpoints {home.run_uri}, "
                 f"data {data_uri or spec.data.factory}")
        metrics, checkpoint_uri, error = run_attempts(spec, home, runtime, data_uri, stop_at_step, run_id,
                                                      callbacks, submitted_at)
        c = spec.checkpoint  # the loop prunes as it goes; the last async uploads land after it stops
        ckpt.prune(home.root.fs, home.run_path, c.num_to_keep, c.keep_best_metric, c.keep_best_mode)
        extra = {"text_data": text_data(spec, data_uri),
                 "exported_model": export_hf(spec, home, checkpoint_uri) if error is None else None}
        summary = write_summary(spec, home, metrics, checkpoint_uri, error, started, extra=extra,
                                interruptions=[r for r in read_interruptions(home.root, home.job) if r.get("run_id") == run_id])
    finally:
        restore_signals()
        release_ray(started_ray)
    if summary["status"] == "succeeded":
        return EXIT_OK, summary
    return (EXIT_STOPPED if summary["status"] == "stopped" else EXIT_FAILED), summary


def write_summary(spec: JobSpec, home: JobHome, metrics: dict, checkpoint_uri: str | None,
                  error: BaseException | None, started: float, interruptions: list[dict], extra: dict | None = None) -> dict:
    """The run's summary, with this run's interruptions (and ``extra``: a model.hf job's tokenized text
    and exported model), written to <job>/summary.json."""
    summary = make_summary(spec, home, metrics, checkpoint_uri, error, time.time() - started)
    summary["interruptions"] = interruptions
    summary.update({k: v for k, v in (extra or {}).items() if v is not None})
    home.root.write_json(summary, home.job, SUMMARY_FILE)
    return summary


def reached_max_steps(metrics: dict, max_steps: int) -> bool:
    """Whether a job's newest verified checkpoint (its manifest's metrics) is at its target
    ``max_steps``: then a rerun has nothing to train, and starts no workers. (A target in
    epochs needs the data to count its steps: such a job goes through the loop, which stops at once.)"""
    return metrics.get("step") is not None and metrics.get("target_step") == max_steps <= metrics["step"]




def first_submitted_at(home: JobHome, now: float) -> float:
    """When the job was first submitted (the service records it; else its first run): goodput's clock."""
    if not home.root.exists(home.job, JOB_FILE):
        home.root.write_json({"submitted_at": now}, home.job, JOB_FILE)
        return now
    return float(home.root.read_json(home.job, JOB_FILE)["submitted_at"])


def stop_on_signals(flag: StopFlag):
    """SIGTERM (`ray job stop`, a process manager) and the first Ctrl-C become a graceful stop:
    checkpoint at the next log step, then exit 3. During the fit a second Ctrl-C is Ray Train's
    own: it aborts the run at once (train_torch.torch_trainer chains the two).

    Only the main thread may set handlers (a sweep's trials run elsewhere); returns the undo.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_term(signum, frame):
        log.info("SIGTERM: stopping at the next log step with a checkpoint (run again to resume)")
        flag.request()

    def on_interrupt(signum, frame):
        log.info("Ctrl-C: stopping at the next log step with a checkpoint (run again to resume); "
                 "Ctrl-C again to abort at once")
        flag.request()

    on_interrupt.graceful_stop = True  # what train_torch.torch_trainer keeps in front of Ray Train's handler
    previous = {sig: signal.signal(sig, handler) for sig, handler in ((signal.SIGTERM, on_term),
                                                                        (signal.SIGINT, on_interrupt))}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def run_attempts(spec: JobSpec, home: JobHome, runtime: Runtime, data_uri: str, stop_at_step: int | None,
                 run_id: str, callbacks: tuple = (), submitted_at: float | None = None
                 ) -> tuple[dict, str | None, BaseException | None]:
    """The one place that carries out retry decisions: fit, classify a failure, retry or stop."""
    ft = spec.fault_tolerance
    user_failures = infra_failures = 0
    previous: str | None = None
    while True:
        if not spec.train_loop:
            forget_ray_snapshot(home)
        nodes_at_start = node_liveness()
        try:
            trainer = build_trainer(spec, home, runtime, data_uri, stop_at_step, run_id, previous, callbacks,
                                    submitted_at)
            with NodeWatch(spec.distributed.resize_check_interval_s,
                           enabled=spec.distributed.min_workers != spec.distributed.max_workers):
                result = trainer.fit()
            if result.metrics:
                return dict(result.metrics), result.checkpoint and result.checkpoint.path, None
            return latest_metrics(home)  # the job was already at its target: nothing ran
        except Exception as exc:  # boundary: decide below whether this attempt's failure is retried
            error = exc
        kind = classify_failure(error)
        if kind == "peer_lost":  # every failed rank lost a peer: did Ray see a node of the cluster die?
            kind = settle_peer_lost(lambda: bool(nodes_died(nodes_at_start, node_liveness())), PEER_LOSS_WAIT_S)
        user_failures += kind == "user_error"
        infra_failures += kind in ("node_lost", "preemption")
        first_line = str(error).strip().splitlines()[-1][:300] if str(error).strip() else type(error).__name__
        if not should_retry(kind, user_failures, ft.max_failures, infra_failures, ft.max_infrastructure_failures):
            log.info(f"giving up after a {kind.replace('_', ' ')}: {type(error).__name__}: {first_line} "
                     f"(user errors {user_failures}/{ft.max_failures}, infrastructure {infra_failures})")
            return (*resume_point(home), error)
        log.info(f"attempt failed: {kind.replace('_', ' ')} ({first_line}); "
                 "retrying from the newest verified checkpoint")
        if kind in ("node_lost", "preemption"):
            settle_cluster_view(error)
        previous = kind




def forget_ray_snapshot(home: JobHome) -> None:
    """Start Ray Train's bookkeeping afresh; our loop restores by listing and verifying.

    Ray keeps a snapshot of the checkpoints it was told about and refuses to start when one
    is gone ("a corrupted run"); our retention deletes old ones on purpose. Deleting the
    snapshot is Ray's documented way to start anew. A user's own ``train_loop`` keeps it,
    since it resumes through ``ray.train.get_checkpoint()``.
    """
    path = posixpath.join(home.run_path, RAY_SNAPSHOT_FILE)
    if home.root.fs.get_file_info(path).type != pafs.FileType.NotFound:
        home.root.fs.delete_file(path)


def latest_metrics(home: JobHome) -> tuple[dict, str | None, None]:
    """The metrics and path of the newest verified checkpoint, from its manifest."""
    chosen, _ = ckpt.find_restore(home.root.fs, home.run_path)
    if chosen is None:
        return {}, None, None
    return dict(ckpt.read_manifest(home.root.fs, chosen.path).get("metrics", {})), chosen.path, None


def resume_point(home: JobHome) -> tuple[dict, str | None]:
    """For a job that gave up: its newest complete checkpoint (what a re-run resumes from, once it
    verifies) and the metrics in its manifest, for the summary. Manifests only: hashing a checkpoint
    of many GB on the driver would delay the failure's report. Anything that goes wrong here leaves
    them out: the job's own failure is what the summary reports."""
    try:
        complete = [c for c in ckpt.list_checkpoints(home.root.fs, home.run_path) if c["complete"]]
    except Exception as exc:  # boundary: the failure being reported must not be replaced by this one
        log.warning(f"could not read the newest checkpoint for the summary ({type(exc).__name__}: {exc})")
        return {}, None
    return (dict(complete[-1]["metrics"]), complete[-1]["path"]) if complete else ({}, None)


def text_data(spec: JobSpec, data_uri: str) -> dict | None:
    """A model.hf job's tokenized text: where, how many rows and tokens, and the padding fraction."""
    if not spec.model.hf:
        return None
    from trainers.data.text import read_meta

    meta = read_meta(data_uri)
    return {"uri": data_uri, **{k: meta[k] for k in ("texts", "rows", "tokens", "mean_length", "padding_fraction")
                                if k in meta}}


def export_hf(spec: JobSpec, home: JobHome, checkpoint_path: str | None) -> str | None:
    """A model.hf job's last checkpoint saved with save_pretrained in <job>/exported/ (its URI)."""
    if not spec.model.hf or not checkpoint_path:
        return None
    from trainers.export import export_pretrained_folder

    return export_pretrained_folder(spec, home, checkpoint_path)


def make_summary(spec: JobSpec, home: JobHome, metrics: dict, checkpoint_path: str | None,
                 error: BaseException | None, wall_time_s: float) -> dict:
    target = metrics.get("target_step", spec.training.max_steps)
    final = metrics.get("step")
    if error is not None:
        status = "failed"
    elif target is not None and final is not None and final < target:
        status = "stopped"
    else:
        status = "succeeded"
    root = home.root
    checkpoint_uri = None
    if checkpoint_path:
        checkpoint_uri = root.uri_of(checkpoint_path[len(root.base):].lstrip("/")) if checkpoint_path.startswith(root.base) else checkpoint_path
    return {
        "name": spec.name, "status": status, "final_step": final, "target_step": target,
        "global_batch_size": spec.training.batch_size, "world_size": metrics.get("world_size"),
        # Out-of-memory healing: the split the run ended with, and how many times it was halved.
        "micro_batch_size": metrics.get("micro_batch_size"),
        "micro_batch_reductions": metrics.get("micro_batch_reductions", 0),
        "samples_per_s": metrics.get("steady_samples_per_s"), "final_loss": metrics.get("loss"),
        "train_seconds": metrics.get("train_seconds"), "wall_time_s": round(wall_time_s, 2),
        "goodput": metrics.get("goodput"), "cost_usd": metrics.get("cost_usd"),
        "savings_usd": metrics.get("savings_usd"),
        "checkpoint_uri": checkpoint_uri, "storage": home.uri,
        "interruptions": [], "error": None if error is None else f"{type(error).__name__}: {error}",
    }
