"""The Ray internals cluster/ray_adapter/logs.py relies on are still where it reaches for them.

These run against the installed (pinned) Ray without starting it: an upgrade that moves or
changes one fails here, by name, before a job meets it.
"""

from __future__ import annotations

import inspect


def test_worker_log_routing_replaces_rays_printer_until_shutdown():
    from ray._private import worker
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    from cluster.ray_adapter.logs import WORKER_LOG_HANDLER, route_worker_logs

    assert callable(worker.print_to_stdstream)  # what connect() registers under the name we replace
    seen = []
    dispatcher.add_handler(WORKER_LOG_HANDLER, lambda data: seen.append(("ray", data)))
    try:
        route_worker_logs(lambda data: seen.append(("ours", data)))
        dispatcher.emit({"lines": ["x"], "is_err": False, "pid": 1})
        assert seen == [("ours", {"lines": ["x"], "is_err": False, "pid": 1})]  # Ray's printer no longer prints
        dispatcher.remove_handler(WORKER_LOG_HANDLER)  # what ray.shutdown() does: ours goes with it
        assert WORKER_LOG_HANDLER not in [name for name, _ in dispatcher.handlers]
    finally:
        dispatcher.remove_handler(WORKER_LOG_HANDLER)


def test_rays_autoscaler_event_filter_takes_the_lines():
    from ray._private.worker import filter_autoscaler_events

    assert list(inspect.signature(filter_autoscaler_events).parameters) == ["lines"]  # it needs a connected Ray
