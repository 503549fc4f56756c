"""The Ray internals behind cluster/ray_adapter.py still exist, with the shapes we call.

If this fails after a Ray upgrade, fix cluster/ray_adapter.py, nothing else: it is the only
module that touches them.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INTERNAL = ("ray._private", "ray._raylet", "ray.experimental.internal_kv", "ray.train.v2._internal")


def test_internal_kv_functions_keep_their_signatures():
    from ray.experimental import internal_kv

    for name, first in (("_internal_kv_get", "key"), ("_internal_kv_put", "key"), ("_internal_kv_exists", "key"),
                        ("_internal_kv_del", "key")):
        fn = getattr(internal_kv, name)
        assert list(inspect.signature(fn).parameters)[0] == first, name


def test_train_health_errors_are_exceptions():
    from cluster.ray_adapter import worker_health_errors

    errors = worker_health_errors()
    assert len(errors) == 2 and all(issubclass(e, Exception) for e in errors)


def test_cluster_config_reader_exists_and_sums_node_groups():
    import ray._private.state as state
    from ray.core.generated import autoscaler_pb2

    assert callable(state.state.get_max_resources_from_cluster_config)
    config = autoscaler_pb2.ClusterConfig()
    group = config.node_group_configs.add()
    group.resources["GPU"] = 1
    group.max_count = 8
    assert state.GlobalState._calculate_max_resource_from_cluster_config(config, "GPU") == 8


def test_worker_log_routing_replaces_rays_printer_until_shutdown():
    from ray._private import worker
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    from cluster.ray_adapter import WORKER_LOG_HANDLER, route_worker_logs

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
