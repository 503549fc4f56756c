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


def test_cluster_config_reader_exists_and_sums_node_groups():
    import ray._private.state as state
    from ray.core.generated import autoscaler_pb2

    assert callable(state.state.get_max_resources_from_cluster_config)
    config = autoscaler_pb2.ClusterConfig()
    group = config.node_group_configs.add()
    group.resources["GPU"] = 1
    group.max_count = 8
    assert state.GlobalState._calculate_max_resource_from_cluster_config(config, "GPU") == 8
