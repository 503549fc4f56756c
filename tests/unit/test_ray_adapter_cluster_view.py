"""The Ray internals cluster/ray_adapter/cluster_view.py relies on are still where it reaches for them.

These run against the installed (pinned) Ray without starting it: an upgrade that moves or
changes one fails here, by name, before a job meets it.
"""

from __future__ import annotations

import inspect

from cluster.ray_adapter import cluster_view


def test_the_coordinator_still_ticks_on_request_and_ray_train_still_reads_it():
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as coordinator
    from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy

    cluster_view._coordinator_refresh_supported()
    assert callable(coordinator.get_or_create_autoscaling_coordinator)
    actor = coordinator._AutoscalingCoordinatorActor
    assert actor.TICK_INTERVAL_S >= 5, "a fast tick would make the refresh unneeded: drop it from the adapter"
    assert "_update_cluster_node_resources" in inspect.getsource(actor._tick)
    assert "get_reserved_resources" in inspect.getsource(ElasticScalingPolicy._get_reserved_resources)


def test_cluster_config_reader_exists_and_sums_node_groups():
    import ray._private.state as state
    from ray.core.generated import autoscaler_pb2

    assert callable(state.state.get_max_resources_from_cluster_config)
    config = autoscaler_pb2.ClusterConfig()
    group = config.node_group_configs.add()
    group.resources["GPU"] = 1
    group.max_count = 8
    assert state.GlobalState._calculate_max_resource_from_cluster_config(config, "GPU") == 8
