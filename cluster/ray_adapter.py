"""Every Ray internal this project touches, in one place, checked against the pinned Ray.

Ray's public API does not offer these; each function names the internal it uses.
`tests/unit/test_ray_adapter.py` imports each internal and checks its signature, so an
upgrade of Ray that moves or renames one fails there, loudly, instead of deep in a job.
Nothing else in the project may import ``ray._private``, ``ray._raylet``,
``ray.experimental.internal_kv`` or ``ray.train.v2._internal``.
"""

from __future__ import annotations

from collections.abc import Callable


def kv_get(key: str) -> bytes | None:
    """A value from the cluster's GCS key-value store (``ray.experimental.internal_kv``)."""
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key)


def kv_put(key: str, value: bytes | str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, value)


def kv_exists(key: str) -> bool:
    from ray.experimental import internal_kv

    return bool(internal_kv._internal_kv_exists(key))


def kv_del(key: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key)


def worker_health_errors() -> tuple[type[BaseException], ...]:
    """Ray Train's errors for a worker that stopped answering (a lost node, not a user bug)."""
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError, WorkerHealthCheckTimeoutError

    return WorkerHealthCheckFailedError, WorkerHealthCheckTimeoutError


def reported_max_resources() -> dict[str, float] | None:
    """The most of each resource the autoscaler may bring up, when the autoscaler reported
    its node groups to the GCS (KubeRay, autoscaler v2); None when nothing was reported.

    Ray Train uses the same call (``ray._private.state.state.get_max_resources_from_cluster_config``)
    to refuse a worker group the cluster can never hold.
    """
    import ray._private.state

    found = ray._private.state.state.get_max_resources_from_cluster_config()
    return {k: float(v) for k, v in found.items()} if found else None


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
