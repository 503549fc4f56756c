"""The driver's printer of worker output and its autoscaler-event filter: `etrain run` routes
forwarded worker lines through its own console (trainers.console) instead of Ray's printer."""

from __future__ import annotations

from collections.abc import Callable

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
