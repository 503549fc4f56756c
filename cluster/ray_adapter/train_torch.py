"""A lean ``TorchTrainer``: Ray Train's torch integration without torch in the driver or the controller.

- Ray Train's SIGINT handler (``DataParallelTrainer._register_sigint_handler``): :func:`torch_trainer`
  keeps `etrain run`'s graceful Ctrl-C in front of it (:func:`first_then`).
- Ray's torch backend steps (``ray.train.torch.config``: ``_setup_torch_process_group``,
  ``_set_torch_distributed_env_vars``, ``_shutdown_torch``): :func:`torch_config` runs them on
  the workers, so that Ray Train's controller never imports torch.
- Ray Train's default callbacks, replaced or left out (train_callbacks.py); its own preemption
  watcher is turned off (``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER``) for the one there.
- The controller's knobs, set in the driver's environment, which Ray Train passes on to the
  controller at ``fit()``: how long a worker group may take to start and how often the controller
  polls its workers (:func:`set_controller_knobs`).
- Ray Train v2's worker health-check exceptions: they tell a lost node from a bug in user code
  (:func:`worker_death_errors`).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import uuid
from collections.abc import Callable

from cluster.ray_adapter.train_callbacks import (_left_out_callback_classes, _preemption_callback_class,
                                                 _recorder_class, _resize_checkpoint_callback_class,
                                                 placement_group_record, remove_recorded_placement_group)

log = logging.getLogger(__name__)

PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"  # ray.train.v2._internal.constants
WORKER_GROUP_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # ..._internal.constants, propagated
HEALTH_CHECK_INTERVAL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"  # ..._internal.constants, propagated


def set_controller_knobs(worker_group_start_timeout_s: float, health_check_interval_s: float) -> None:
    """Ray Train propagates its RAY_TRAIN_* settings from the driver to its controller: set them
    here, before ``fit()``, unless the user set them. ``health_check_interval_s``: how often the
    controller polls its workers."""
    os.environ.setdefault(WORKER_GROUP_START_TIMEOUT_ENV, str(worker_group_start_timeout_s))
    os.environ.setdefault(HEALTH_CHECK_INTERVAL_ENV, str(health_check_interval_s))


def worker_death_errors() -> tuple[type[BaseException], ...]:
    """Ray Train's errors for a worker that stopped answering (its node died)."""
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError, WorkerHealthCheckTimeoutError

    return WorkerHealthCheckFailedError, WorkerHealthCheckTimeoutError




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
