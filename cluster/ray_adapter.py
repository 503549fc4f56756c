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
  (Ray Train's placement-group cleaner) then query the dead address until they time out.
- The driver's printer of worker output and its autoscaler-event filter: `etrain run` routes
  forwarded worker lines through its own console instead of Ray's printer.

It lives in cluster/, the lowest layer, so trainers/ and cluster/ share it; nothing else in
the project may import ``ray._private``, ``ray._raylet``, ``ray.experimental.internal_kv``
or ``ray.train.v2._internal``.
tests/unit/test_ray_adapter.py fails loudly when Ray moves or changes any of these.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path


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
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

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


def address_record() -> Path:
    """The file in which `ray start` records its cluster's address for ``address="auto"``
    (Ray's temp dir: RAY_TMPDIR, else TMPDIR, else /tmp); `ray stop` removes it."""
    from ray._common.utils import get_ray_address_file

    return Path(get_ray_address_file(None))


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
