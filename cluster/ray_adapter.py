"""Every Ray internal this project touches, in one place, checked against the pinned Ray.

- Ray's GCS key-value store (``ray.experimental.internal_kv``): a job's stop request and
  heartbeat live there; they outlive the workers, not the cluster.
- Ray Train v2's worker health-check exceptions: they tell a lost node from a bug in user code.
- Ray Data's AutoscalingCoordinator: Ray Train's elastic policy sizes a (re)started worker
  group from the node list this actor keeps, refreshed every 20 s. Right after a node is lost
  or drained that list still holds it: the group is planned for a ghost and waits out the
  worker-start timeout. :func:`refresh_cluster_view` makes the actor read the nodes now.
- The dashboard address of the Ray this process is connected to (Ray has no public getter).
- The most of each resource the autoscaler may bring up, when it reported its node groups to
  the GCS (``use_gpu: auto`` reads it through cluster.capacity).
- Where `ray start` records the address of the cluster it started (``ray_current_cluster``):
  a Ray that was killed leaves it behind, and Ray's own "auto" lookups inside a new cluster
  (a Ray Jobs driver's ``ray.init()``, `ray status`) then query the dead address until they time out.
- The driver's printer of worker output and its autoscaler-event filter: `etrain run` routes
  forwarded worker lines through its own console instead of Ray's printer.
- Ray Train's SIGINT handler (``DataParallelTrainer._register_sigint_handler``): :func:`torch_trainer`
  keeps `etrain run`'s graceful Ctrl-C in front of it (:func:`first_then`).
- Ray's torch backend steps (``ray.train.torch.config``: ``_setup_torch_process_group``,
  ``_set_torch_distributed_env_vars``, ``_shutdown_torch``): :func:`torch_config` runs them on
  the workers, so that Ray Train's controller never imports torch.
- Ray Train's default callbacks: a trainer given no Ray Dataset still starts an actor to
  hand out dataset shards (one more process, ~1.5 CPU-s, at every start and restart);
  :func:`torch_trainer` leaves that callback out when there are no datasets. It also replaces
  the placement-group cleaner (``PlacementGroupCleanerCallback``: a detached actor per run that
  asks the dashboard's state API every second whether the controller lives): see
  :class:`PlacementGroupRecorder`.
- Ray Train's preemption watcher (``PreemptionCallback`` starts a ``PreemptionWatcher`` actor at
  every worker-group start: a process, ~1.4 CPU-s of imports, at each start and restart). It is
  what turns a node drain (a spot notice) into each rank's ``get_preemption_info()``, so it stays,
  as a thread of the controller: :func:`torch_trainer` turns Ray's off
  (``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER``) and adds :class:`InProcessPreemptionCallback`.
- The GCS port of a local start (``RAY_GCS_SERVER_PORT``, read by ``ray._private.node``): a
  local Ray tells its own processes where it is (:func:`init_local_ray`).
- The session folder of the Ray this process started (``ray._private.worker._global_node``):
  :func:`shutdown_local_ray` stops the workers of that Ray that hang on after it (cluster/leftovers.py).
- Ray's loopback switch (``ray_constants.ENABLE_RAY_CLUSTER``, read from
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when ray is imported): off, Ray keeps 127.0.0.1
  instead of swapping in the machine's address (:func:`keep_on_loopback`).
- Which thread of a Ray Train worker does what: Ray's core worker keeps the process's main
  thread in its task-execution loop, which wakes every 10 ms to check for signals
  (``CoreWorker::RunTaskExecutionLoop``, "CoreWorker.CheckSignal"), and Ray Train v2 runs the
  training function in a thread of its own (``ThreadRunner``): :func:`batch_schedule_worker`.
- Ray Train's controller hooks around a resize (``ControllerCallback``: the ``ResizingState`` a
  running group enters when the cluster has room for a different one, then
  ``before_controller_execute_resize_decision``) and a worker's ``execute_async``: before the
  controller restarts a healthy group to resize it, each rank checkpoints
  (:class:`CheckpointBeforeResize`).
- The run's storage filesystem (``get_context().get_storage()``, a DeveloperAPI): checkpoints are
  written in place and reported without an upload, which Ray accepts only on that filesystem
  and under the run's folder (:func:`run_storage_filesystem`).
- The headers with which a client tells Ray Serve's proxy its own request timeout or asks to be
  served after it hangs up (``ray.serve._private.constants``): the service refuses a request that
  carries one (:func:`serve_client_override_headers`).
- The one-key mappings Ray Tune's variant generator acts on inside a search space's values
  (``ray.tune.search.variant_generator``: ``{"eval": "<python>"}`` runs, ``{"grid_search": [...]}``
  expands into trials), at any depth: :data:`TUNE_EXPRESSION_KEYS`. A sweep's listed values go to
  Tune as indices, and a value holding one of these is refused besides (trainers.sweep).

It lives in cluster/, the lowest layer, so trainers/ and cluster/ share it; nothing else in
the project may import ``ray._private``, ``ray._raylet``, ``ray.experimental.internal_kv``,
``ray.train.v2._internal`` or ``ray.serve._private``.
tests/unit/test_ray_adapter.py fails loudly when Ray moves or changes any of these.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import ipaddress
import logging
import os
import signal
import socket
import uuid
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

TUNE_EXPRESSION_KEYS = ("eval", "grid_search")


def serve_client_override_headers() -> tuple[str, ...]:
    """The request headers that let a client lift Ray Serve's request timeout for itself, or be served
    after it disconnects: a service that bounds what one client may cost refuses them."""
    from ray.serve._private import constants

    return (constants.SERVE_HTTP_REQUEST_TIMEOUT_S_HEADER, constants.SERVE_HTTP_REQUEST_DISCONNECT_DISABLED_HEADER)

GCS_PORT_ENV = "RAY_GCS_SERVER_PORT"  # ray._private.ray_constants.GCS_PORT_ENVIRONMENT_VARIABLE
REFRESH_REQUESTER = "etrain-refresh"  # owns no request: asking for its reservation only ticks the actor


def kv_get(key: bytes) -> bytes | None:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key)


def kv_put(key: bytes, value: bytes | str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, value)


def kv_exists(key: bytes) -> bool:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_exists(key)


def kv_del(key: bytes) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key)


def worker_death_errors() -> tuple[type[BaseException], ...]:
    """Ray Train's errors for a worker that stopped answering (its node died)."""
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError, WorkerHealthCheckTimeoutError

    return WorkerHealthCheckFailedError, WorkerHealthCheckTimeoutError


def _coordinator_refresh_supported() -> None:
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import _AutoscalingCoordinatorActor

    if "recompute" not in inspect.signature(_AutoscalingCoordinatorActor.get_reserved_resources).parameters:
        raise RuntimeError("Ray's AutoscalingCoordinator.get_reserved_resources lost its 'recompute' argument: "
                           "cluster/ray_adapter.py needs another way to refresh Ray Train's node list")


def refresh_cluster_view(timeout_s: float = 10.0) -> None:
    """Have Ray Train's planner see the nodes as they are now (one coordinator tick)."""
    import ray
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import \
        get_or_create_autoscaling_coordinator

    _coordinator_refresh_supported()
    coordinator = get_or_create_autoscaling_coordinator()
    ray.get(coordinator.get_reserved_resources.remote(REFRESH_REQUESTER, recompute=True), timeout=timeout_s)


def dashboard_url() -> str:
    """The Jobs API address of the Ray this process is connected to."""
    from ray._private.worker import get_dashboard_url

    url = get_dashboard_url()
    return url if url.startswith("http") else f"http://{url}"


def reported_max_resources() -> dict[str, float] | None:
    """The most of each resource the autoscaler may bring up, when the autoscaler reported
    its node groups to the GCS (KubeRay, autoscaler v2); None when nothing was reported.

    Ray Train uses the same call (``ray._private.state.state.get_max_resources_from_cluster_config``)
    to refuse a worker group the cluster can never hold.
    """
    import ray._private.state

    found = ray._private.state.state.get_max_resources_from_cluster_config()
    return {k: float(v) for k, v in found.items()} if found else None


def ray_temp_dir() -> Path:
    """Ray's temp folder on this node as `ray start` picks it (RAY_TMPDIR, else TMPDIR, else /tmp,
    then ``ray``): the address record and the Prometheus discovery file live there."""
    from ray._common.utils import get_default_ray_temp_dir

    return Path(get_default_ray_temp_dir())


def address_record() -> Path:
    """The file in which `ray start` records its cluster's address for ``address="auto"``
    (in :func:`ray_temp_dir`); `ray stop` removes it."""
    from ray._common.utils import get_ray_address_file

    return Path(get_ray_address_file(str(ray_temp_dir())))


WORKER_LOG_HANDLER = "ray_print_logs"


def route_worker_logs(handler: Callable[[dict], None]) -> None:
    """Send the log lines Ray forwards from workers to the driver to ``handler`` instead of Ray's
    printer, for as long as this process stays connected. ``handler`` gets Ray's batch:
    ``{"lines", "is_err", "pid", "actor_name", "task_name", ...}``. Ray prints through
    ``ray._private.worker.print_to_stdstream``, registered as ``ray_print_logs`` on
    ``ray._private.ray_logging.global_worker_stdstream_dispatcher`` when ``ray.init(log_to_driver=True)``
    connects and removed by that name at ``ray.shutdown()``; there is no public hook for it.
    """
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    dispatcher.remove_handler(WORKER_LOG_HANDLER)
    dispatcher.add_handler(WORKER_LOG_HANDLER, handler)


def autoscaler_events(lines: list[str]) -> list[str]:
    """The events among the autoscaler's forwarded lines (its status dumps dropped), as Ray's
    own printer shows them (``ray._private.worker.filter_autoscaler_events``)."""
    from ray._private.worker import filter_autoscaler_events

    return list(filter_autoscaler_events(lines))


def local_preemption_info():
    """This worker's own copy of a spot notice (Ray Train sets it when a node drain names the group),
    read without the cross-rank barrier of ``ray.train.get_preemption_info``: the training loop
    checks it often and agrees on it in an all-reduce it already does."""
    from ray.train.v2._internal.execution.context import get_train_context

    return get_train_context().preemption_context.preemption_info


BATCH_EVERY_THREAD = "SCHED_BATCH, every thread"  # what batch_schedule_worker says when it moved them all


def batch_schedule_worker(whole_process: bool) -> str:
    """Called from the training thread of a Ray Train worker: put Ray's main thread (its 10 ms
    signal check), or with ``whole_process`` every thread of the process, under SCHED_BATCH.
    Returns what it did, in words, for the worker's log and its checkpoints.

    A waking SCHED_BATCH thread does not preempt the thread running on its core (the kernel's
    wake-up preemption check passes over any policy but SCHED_NORMAL; sched(7) calls it "mildly
    disfavored"); it runs at the next switch, at most a few ms later. Under the default policy the
    wake-ups of a rank's helper threads (Ray's signal check, ~130 a second; each of gloo's transport
    threads ~900-1,300, counted in /proc's voluntary context switches during training) land on
    cores where the ranks compute, and DDP's ranks move in lockstep, so a stalled rank stalls
    them all. Measured with 2 gloo ranks on 2 cores, side by side in turns: our loop at 0.87-0.90
    of torchrun's samples/s as torchrun runs by default, 1.13 with every thread of our ranks under
    SCHED_BATCH, 0.90 with Ray's main thread alone (gloo's threads, started before the loop runs,
    kept the default). On a GPU the training thread launches kernels and should wake at once:
    only the main thread moves there (``whole_process`` False). Threads and processes started
    later (loader workers, a user factory's own, checkpoint uploads) inherit the policy of the
    thread that starts them.

    Moving to SCHED_BATCH needs no privilege; a refusal (a sandbox's seccomp, no /proc) leaves
    every thread as it was, and training goes on.
    """
    import threading

    if not hasattr(os, "SCHED_BATCH"):
        return "default scheduling (SCHED_BATCH is Linux's)"
    if threading.current_thread() is threading.main_thread():
        return "default scheduling (the training function runs on Ray's main thread)"
    moved: list[tuple[int, int, os.sched_param]] = []
    try:
        # Linux: a thread id names one thread; the main thread's is the process id.
        threads = sorted(int(t) for t in os.listdir("/proc/self/task")) if whole_process else [os.getpid()]
        for tid in threads:
            try:
                was = (tid, os.sched_getscheduler(tid), os.sched_getparam(tid))
                os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
            except ProcessLookupError:  # a thread that ended since the listing
                continue
            moved.append(was)
    except OSError as exc:
        for tid, policy, param in moved:  # all or nothing: a mix would be neither setting measured
            with contextlib.suppress(OSError):
                os.sched_setscheduler(tid, policy, param)
        return f"default scheduling (SCHED_BATCH refused: {exc.strerror or exc})"
    return BATCH_EVERY_THREAD if whole_process else "SCHED_BATCH, Ray's main thread"


LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # ray._private.ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, not an address
        return False


def keep_on_loopback() -> dict[str, str]:
    """Have Ray keep a loopback address in this process; returns the environment that keeps it
    in the processes a local start launches (GCS, raylet, and through the raylet, the workers).

    Ray swaps 127.0.0.1 for the machine's outward address (``resolve_ip_for_localhost``) unless
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER says off, and reads that once, when ray is imported: a
    script that imported ray before setting it (anything but ``import trainers``, which sets it
    first) would start its local Ray on the outward address. The flag stays off in this process:
    what it does with its Ray later must agree on the node's address. A value the user set that
    turns it on is kept (Ray's own behaviour; :func:`init_local_ray` then says what happened).
    """
    from ray._private import ray_constants

    if os.environ.get(LOOPBACK_ENV, "0").lower() in ("true", "1"):  # read as Ray's env_bool reads it
        return {}
    ray_constants.ENABLE_RAY_CLUSTER = False
    return {LOOPBACK_ENV: os.environ.get(LOOPBACK_ENV, "0")}


LOCAL_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}


def init_local_ray(host: str = "127.0.0.1", **init_kwargs) -> str:
    """Start a local Ray (``ray.init(address="local")``) whose every process knows its address.

    Ray's lookups inside a cluster that are given no address (a Ray Jobs driver's ``ray.init()``,
    the state API's clients) read RAY_ADDRESS, else the record `ray start` leaves, else any GCS
    process on this machine. A local start sets none of them: with a second Ray on the machine (a
    user's own, another job's) such a lookup fails on "Found multiple active Ray instances", and a
    record naming the other Ray has it act on that one (Ray Train's placement-group cleaner, now
    replaced, once removed a live run's placement group so). Ray takes no GCS
    port for a local start but reads ``RAY_GCS_SERVER_PORT`` when it starts a head, and its
    processes inherit this process's environment as they start: with both set around ray.init,
    each of them is pinned to this cluster, and on a loopback ``host`` kept there
    (:func:`keep_on_loopback`). This process's own environment is restored after, so what it
    starts later chooses for itself. Returns the GCS address.

    Ray prestarts idle workers for the first driver, which our jobs never use: every actor of
    a training run (controller, workers) carries a runtime env, so Ray starts a process of its
    own for each. Prestarted, they cost ~1.4 CPU-s each at the start and ~0.5 CPU-s a minute
    idle; :data:`LOCAL_SYSTEM_CONFIG` turns that off (a caller's ``_system_config`` adds to it).
    """
    import ray

    init_kwargs["_system_config"] = {**LOCAL_SYSTEM_CONFIG, **init_kwargs.get("_system_config", {})}

    with socket.socket() as s:  # a free port; the GCS binds it a moment later
        s.bind((host, 0))
        port = s.getsockname()[1]
    address = f"{host}:{port}"
    pinned = {GCS_PORT_ENV: str(port), "RAY_ADDRESS": address, **(keep_on_loopback() if is_loopback(host) else {})}
    saved = {k: os.environ.get(k) for k in pinned}
    os.environ.update(pinned)
    try:
        ray.init(address="local", _node_ip_address=host, **init_kwargs)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    started = ray.get_runtime_context().gcs_address
    problem = local_start_problem(started, address)
    if problem:
        ray.shutdown()
        raise RuntimeError(problem)
    return address


def session_folder(started_here: bool = False) -> Path | None:
    """The session folder of the Ray this process is connected to; None when not connected, or,
    with ``started_here``, when this process joined that Ray rather than started it."""
    from ray._private import worker

    node = worker._global_node
    if node is None or (started_here and not node.head):  # only a local start makes this process a head node
        return None
    return Path(node.get_session_dir_path())


def shutdown_local_ray(grace_s: float = 10.0) -> list[int]:
    """``ray.shutdown()`` a Ray this process started, then stop by pid its workers that outlive it
    (a teardown that hangs: cluster/leftovers.py). Returns their pids (none, normally). For a Ray
    this process only joined it is a plain ``ray.shutdown()``: that Ray's workers are running."""
    import ray

    from cluster.leftovers import stop_leftovers

    folder = session_folder(started_here=True)
    ray.shutdown()
    return stop_leftovers(folder, grace_s) if folder is not None else []


def local_start_problem(started: str, address: str) -> str | None:
    """Why a local Ray is not where :func:`init_local_ray` asked for it, or None."""
    if started == address:
        return None
    if started.rpartition(":")[2] == address.rpartition(":")[2] and not is_loopback(started.rpartition(":")[0]):
        return (f"Ray started its GCS at {started}, not at {address}: it swapped the loopback address for the "
                f"machine's because {LOOPBACK_ENV}={os.environ.get(LOOPBACK_ENV)!r}; unset it (or set it to 0) "
                "to keep a local Ray on loopback")
    return (f"Ray started its GCS at {started}, not at {address} ({GCS_PORT_ENV} ignored): "
            "cluster/ray_adapter.py needs another way to give a local Ray's processes its address")


def _left_out_callback_classes() -> tuple[type, type]:
    """Ray Train's dataset-shard callback and its placement-group cleaner (see :func:`torch_trainer`)."""
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    return DatasetsCallback, PlacementGroupCleanerCallback


PG_KEY_PREFIX = b"etrain/placement-group/"


def _recorder_class():
    """Built on first use: a Ray Train callback class (Ray Train is imported only when a trainer is)."""
    from ray.train.v2._internal.execution.callback import WorkerGroupCallback

    class PlacementGroupRecorder(WorkerGroupCallback):
        """Records each worker group's placement group where the driver finds it.

        Ray Train's controller runs on the driver's node and its placement groups belong to the
        driver's job: when the driver dies, Ray removes them with the job. Only a controller that
        dies while its driver lives (killed, out of memory) leaves one holding the workers' CPUs
        or GPUs, and the driver is the one to see that: its ``fit()`` raises. A sweep trial's
        driver is a Tune actor of the sweep's job, ended with its controller when Tune stops the
        trial: there the sweep's driver removes the group, by the trial's record
        (``placement_group_key``, trainers.sweep.trial_cleanup_callback). Ray's cleaner
        watches for it with a detached actor per run (a process, ~2.3 CPU-s of imports, on the
        path to the first step), polling the dashboard every second and waiting out a poll when
        the run ends: measured here, a 20-step run took 16-18 s and 28 CPU-s with it, 12-13 s and
        20 CPU-s without. This callback writes the group's placement-group id to Ray's KV, and
        the driver's ``fit()`` removes it when the controller could not.
        """

        def __init__(self, key: bytes):
            self.key = key

        def after_worker_group_start(self, worker_group) -> None:
            state = worker_group.get_worker_group_state()
            kv_put(self.key, state.placement_group_handle.placement_group.id.binary())

    return PlacementGroupRecorder


_resize_handler: Callable[[float], int | None] | None = None


def on_resize_request(handler: Callable[[float], int | None] | None) -> None:
    """On a worker: who checkpoints when the controller is about to restart the group to resize it
    (the trainer, while its attempt trains; None once it ends). ``handler(timeout_s)`` returns the
    step of the checkpoint it took, or None."""
    global _resize_handler
    _resize_handler = handler


def checkpoint_before_resize(timeout_s: float) -> int | None:
    """Run on each worker by :class:`CheckpointBeforeResize` (in Ray's actor thread, beside the
    training thread): the step of the checkpoint taken, or None (no training running here)."""
    handler = _resize_handler
    return handler(timeout_s) if handler is not None else None


def _resize_checkpoint_callback_class():
    """Built on first use, like :func:`_recorder_class`."""
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
    from ray.train.v2._internal.execution.controller.state import ResizingState

    class CheckpointBeforeResize(ControllerCallback, WorkerGroupCallback):
        """Before Ray Train restarts a running group to resize it, every rank checkpoints.

        Ray Train grows a group (``num_workers: {min, max}``) by shutting it down and starting a
        bigger one, which then resumes from the newest checkpoint: the steps since it were lost,
        up to a checkpoint interval, more when the restart caught a checkpoint mid-write. Here the
        controller, once it has decided (a running group enters ``ResizingState``; a restart
        after a failure does not, and its workers may be gone), asks each worker and waits for
        every answer, ``timeout_s`` at most (``distributed.resize_checkpoint_timeout_s``): the
        ranks agree on the request at their next sync step, as on a stop, rank 0 writes the
        checkpoint and each rank answers once it is written, before any report to Ray (whose
        controller is the one waiting here); the restart finds it in storage. Meanwhile the
        controller's loop and each worker's actor thread wait with it (a second Ctrl-C's abort
        and a spot notice's marks queue behind it); after it the group is shut down whatever
        the answers.
        """

        def __init__(self, timeout_s: float):
            self.timeout_s = timeout_s
            self._group = None
            self._planned = False

        def after_worker_group_start(self, worker_group) -> None:
            self._group = worker_group

        def after_worker_group_shutdown(self, worker_group_context) -> None:
            self._group = None

        def after_worker_group_abort(self, worker_group_context) -> None:
            self._group = None

        def after_controller_state_update(self, previous_state, current_state) -> None:
            if isinstance(current_state, ResizingState):
                self._planned = True

        def before_controller_execute_resize_decision(self, resize_decision) -> None:
            planned, self._planned = self._planned, False
            if not planned or self._group is None or self.timeout_s <= 0:
                return
            import ray

            try:
                refs = [w.execute_async(checkpoint_before_resize, self.timeout_s) for w in self._group.get_workers()]
                ready, late = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s + 5)
            except Exception:  # boundary: a resize goes ahead without it, from the newest checkpoint as before
                log.warning("could not ask the workers to checkpoint before the resize", exc_info=True)
                return
            answers = []
            for ref in ready:
                try:
                    answers.append(ray.get(ref))
                except Exception as exc:  # a rank that died meanwhile: the others' answers still count
                    answers.append(f"{type(exc).__name__}")
            log.info("resizing to %s workers: checkpoints before the restart at steps %s%s", resize_decision.num_workers,
                     answers, f"; {len(late)} ranks did not answer in {self.timeout_s:g} s" if late else "")

    return CheckpointBeforeResize


PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"  # ray.train.v2._internal.constants


def _preemption_callback_class():
    """Built on first use, like :func:`_recorder_class`."""
    from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback
    from ray.train.v2._internal.execution.preemption import PreemptionWatcher

    class InProcessPreemptionCallback(PreemptionCallback):
        """Ray's preemption watcher, run as a thread of the controller instead of an actor of its own.

        The watcher polls the GCS for drained nodes every few seconds and, when one of the group's
        nodes drains, marks every rank preempted: a plain object with a daemon thread, which Ray
        wraps in an actor for each worker-group start. Here the same object runs in the
        controller's process (which outlives every group it starts): the same drains seen, the
        same marks sent, one process fewer per start. Stopping it ends its thread at its next wait.
        """

        def after_worker_group_start(self, worker_group) -> None:
            self._stop_watcher()
            node_to_ranks: dict[str, list[int]] = {}
            actors_by_rank = {}
            for worker in worker_group.get_workers():
                rank = worker.distributed_context.world_rank
                node_to_ranks.setdefault(worker.metadata.node_id, []).append(rank)
                actors_by_rank[rank] = worker.actor
            self._watcher = PreemptionWatcher(node_to_ranks=node_to_ranks, poll_interval_s=self._poll_interval_s,
                                              worker_actors_by_rank=actors_by_rank)

        def _stop_watcher(self) -> None:
            watcher, self._watcher = self._watcher, None
            if watcher is not None:
                watcher._stop_event.set()

    return InProcessPreemptionCallback


def remove_recorded_placement_group(key: bytes) -> None:
    """Remove the placement group recorded under ``key`` if it is still there (its controller
    died without removing it); forget the record."""
    import ray
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    recorded = kv_get(key)
    if recorded is None:
        return
    pg = PlacementGroup(PlacementGroupID(recorded))
    if placement_group_table(pg).get("state") not in (None, "REMOVED"):
        try:
            remove_placement_group(pg)
        except ray.exceptions.RaySystemError:  # removed meanwhile
            pass
    kv_del(key)  # only now: a removal that failed is found again by the next caller


def _set_master_address(addr: str, port: int) -> None:
    """On each worker: where rank 0 listens (torch.distributed's ``env://``)."""
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)


def _set_torch_env_vars() -> None:
    """On each worker: RANK, LOCAL_RANK, WORLD_SIZE... as Ray's TorchConfig sets them."""
    from ray.train.torch.config import _set_torch_distributed_env_vars

    _set_torch_distributed_env_vars()


def _setup_process_group(**kwargs) -> None:
    """On each worker: Ray's own process-group set-up (torch is imported there, where it is used)."""
    from ray.train.torch.config import _setup_torch_process_group

    _setup_torch_process_group(**kwargs)


def _shutdown_process_group(destroy_process_group: bool) -> None:
    from ray.train.torch.config import _shutdown_torch

    _shutdown_torch(destroy_process_group=destroy_process_group)


class WorkerDeviceContext:
    """Ray's ``TorchConfigContextManager`` (each worker's default CUDA device is its own), imported on
    the worker when the loop starts: the driver names this class to Ray Train without torch."""

    def __enter__(self):
        from ray.train.torch.config import TorchConfigContextManager

        self._ray_context = TorchConfigContextManager()
        return self._ray_context.__enter__()

    def __exit__(self, *exc) -> bool:
        return self._ray_context.__exit__(*exc)


@functools.cache
def _lean_torch_config_class() -> type:
    """Built on first use, as Ray Train is imported only when a trainer is (pickled by value)."""
    import ray
    from ray.train.backend import Backend, BackendConfig
    from ray.train.constants import (DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
                                     TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)

    class LeanTorchBackend(Backend):
        """Ray's ``_TorchBackend`` for CPUs and GPUs, its steps run through the functions above."""

        share_cuda_visible_devices = True

        def on_start(self, worker_group, backend_config) -> None:
            from ray.train._internal.utils import get_address_and_port

            gpus = worker_group.get_resources_per_worker().get("GPU", 0)
            backend = backend_config.backend or ("nccl" if gpus > 0 else "gloo")
            addr, port = worker_group.execute_single(0, get_address_and_port)
            worker_group.execute(_set_master_address, addr=addr, port=port)
            worker_group.execute(_set_torch_env_vars)
            ray.get([worker_group.execute_single_async(rank, _setup_process_group, backend=backend, world_rank=rank,
                                                       world_size=len(worker_group), init_method="env://",
                                                       timeout_s=backend_config.timeout_s)
                     for rank in range(len(worker_group))])

        def on_shutdown(self, worker_group, backend_config) -> None:
            futures = worker_group.execute_async(_shutdown_process_group, destroy_process_group=len(worker_group) > 1)
            timeout_s = int(os.environ.get(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S))
            try:
                ray.get(futures, timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                log.warning("torch process group shutdown timed out after %d s", timeout_s)

    class LeanTorchConfig(BackendConfig):
        """What ``TorchConfig(backend, timeout_s)`` configures (``init_method`` env), see :func:`torch_config`."""

        def __init__(self, backend: str | None = None, timeout_s: int = 1800):
            self.backend, self.init_method, self.timeout_s = backend, "env", timeout_s

        @property
        def backend_cls(self):
            return LeanTorchBackend

        @property
        def train_func_context(self):  # read by the driver (no torch there), entered by each worker
            return WorkerDeviceContext

        @property
        def framework(self):
            from ray.train.v2._internal.util import TrainingFramework

            return TrainingFramework.TORCH

        def to_dict(self) -> dict:
            return {"backend": self.backend, "init_method": self.init_method, "timeout_s": self.timeout_s}

        def __repr__(self) -> str:
            return f"LeanTorchConfig({self.to_dict()})"

    return LeanTorchConfig


def torch_config(backend: str | None = None, timeout_s: int = 1800):
    """Ray's ``TorchConfig(backend=..., timeout_s=...)`` without torch in the controller.

    Ray Train's controller unpickles the trainer's backend config; ``TorchConfig`` lives in
    ``ray.train.torch.config``, which imports torch: ~1.6 CPU-s (most of the controller's imports,
    measured with PYTHONPROFILEIMPORTTIME) on the path to every start and restart, in a process
    that never touches a tensor. This config's backend runs Ray's own worker-side steps
    (``_setup_torch_process_group``, ``_set_torch_distributed_env_vars``, ``_shutdown_torch``)
    through module functions that import them on the worker. ``backend`` None picks nccl with
    GPUs, else gloo (as Ray does; TPUs are not ours).
    """
    return _lean_torch_config_class()(backend=backend, timeout_s=timeout_s)


def placement_group_record(run_key: str) -> bytes:
    """Where the placement group of the run named ``run_key`` is recorded (:class:`PlacementGroupRecorder`)."""
    return PG_KEY_PREFIX + run_key.encode()


def torch_trainer(*args, placement_group_key: str | None = None, resize_checkpoint_timeout_s: float = 120.0, **kwargs):
    """A ``ray.train.torch.TorchTrainer`` that starts no dataset-shard actor when it has no
    datasets (ours read their data in the loop) and no placement-group cleaner actor (the driver
    cleans up instead: :class:`PlacementGroupRecorder`), and whose preemption watcher is a
    thread of the controller (:class:`InProcessPreemptionCallback`), not an actor: each start
    and restart of a job spawns three processes fewer. A resize of a running group waits for
    its ranks' checkpoint, ``resize_checkpoint_timeout_s`` at most (:class:`CheckpointBeforeResize`).
    Ray Train builds its callbacks in
    ``_create_default_callbacks``; the controller adds its own watcher unless the environment it
    is given (Ray Train's RAY_TRAIN_* variables, from the driver's at ``fit()``) turns it off.
    Its backend config is :func:`torch_config`'s unless one is given: no torch in the controller.

    It is Ray's ``TorchTrainer`` without its module: that class is a ``DataParallelTrainer`` with
    a torch backend config, but ``ray.train.torch`` (which every path to it imports) imports torch,
    ~1.7 CPU-s and ~300 MB in every driver (`etrain run`, each Ray Jobs driver of the service,
    each sweep trial's) that only starts workers.

    ``placement_group_key``: record the workers' placement group under a name someone else
    knows (:func:`placement_group_record`), for a driver that may be torn down mid-fit with no
    ``fit()`` left to remove it: Tune stops a trial by ending its actor. Otherwise a name only
    this trainer knows."""
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    datasets_callback, pg_cleaner_callback = _left_out_callback_classes()
    recorder, preemption_callback = _recorder_class(), _preemption_callback_class()
    resize_callback = _resize_checkpoint_callback_class()
    default_config = torch_config

    class LeanTorchTrainer(DataParallelTrainer):
        # this class is made per trainer
        pg_key = placement_group_record(placement_group_key or uuid.uuid4().hex)

        def __init__(self, train_loop_per_worker, *, torch_config=None, **rest):
            super().__init__(train_loop_per_worker, backend_config=torch_config or default_config(), **rest)

        def _create_default_callbacks(self):
            left_out = (pg_cleaner_callback,) if self.datasets else (pg_cleaner_callback, datasets_callback)
            kept = [c for c in super()._create_default_callbacks() if not isinstance(c, left_out)]
            return [*kept, recorder(self.pg_key), preemption_callback(), resize_callback(resize_checkpoint_timeout_s)]

        def fit(self):
            os.environ[PREEMPTION_WATCHER_ENV] = "0"  # ours runs instead (a second would mark each rank twice)
            try:
                return super().fit()
            finally:
                try:
                    remove_recorded_placement_group(self.pg_key)
                except Exception:  # Ray itself gone: its placement groups went with it; fit()'s own error stands
                    log.warning("could not check for a placement group left by the run's controller", exc_info=True)

        def _register_sigint_handler(self, controller):
            ours = signal.getsignal(signal.SIGINT)
            super()._register_sigint_handler(controller)
            if getattr(ours, "graceful_stop", False):
                signal.signal(signal.SIGINT, first_then(ours, signal.getsignal(signal.SIGINT)))

    return LeanTorchTrainer(*args, **kwargs)


def first_then(first: Callable, later: Callable) -> Callable:
    """A signal handler that runs ``first`` for the first signal and ``later`` for every one after.

    Ray Train's ``fit()`` replaces the process's SIGINT handler with its own
    (``DataParallelTrainer._register_sigint_handler``: abort the controller at once, exit). A
    handler of ours marked ``graceful_stop`` (trainers.launch: a stop with a checkpoint) is kept in
    front of it: the first Ctrl-C stops gracefully, a second aborts as Ray would.
    """
    calls = [0]

    def handler(signum, frame):
        calls[0] += 1
        (first if calls[0] == 1 else later)(signum, frame)

    handler.graceful_stop = getattr(first, "graceful_stop", False)  # a retry's fit chains it again
    return handler


def run_storage_filesystem():
    """The filesystem Ray Train holds for this run's storage. A checkpoint reported in place (no
    upload by Ray) must be on it: Ray compares the filesystem objects, not just the paths.
    ``get_storage()`` is a DeveloperAPI that Ray may change between minor versions."""
    import ray.train

    return ray.train.get_context().get_storage().storage_filesystem


def trial_actor(trial):
    """The Ray actor running a Tune trial, or None once Tune has let it go. Tune has no public
    getter (``Trial.temporary_state.ray_actor``); a sweep waits for the actor to end before it
    removes the trial's placement group (trainers.sweep.trials.trial_cleanup_callback)."""
    return trial.temporary_state.ray_actor
