"""The Ray internals trainers/ray_adapter.py relies on are still where it reaches for them.

These run against the installed (pinned) Ray without starting it: an upgrade that moves or
changes one fails here, by name, before a job meets it.
"""

from __future__ import annotations

import inspect

from trainers import ray_adapter


def test_the_kv_store_functions_exist():
    from ray.experimental import internal_kv

    for name in ("_internal_kv_get", "_internal_kv_put", "_internal_kv_exists", "_internal_kv_del"):
        assert callable(getattr(internal_kv, name)), name


def test_worker_death_errors_are_exceptions():
    errors = ray_adapter.worker_death_errors()
    assert len(errors) == 2 and all(issubclass(e, BaseException) for e in errors)


def test_the_coordinator_still_ticks_on_request_and_ray_train_still_reads_it():
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as coordinator
    from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy

    ray_adapter._coordinator_refresh_supported()
    assert callable(coordinator.get_or_create_autoscaling_coordinator)
    actor = coordinator._AutoscalingCoordinatorActor
    assert actor.TICK_INTERVAL_S >= 5, "a fast tick would make the refresh unneeded: drop it from the adapter"
    assert "_update_cluster_node_resources" in inspect.getsource(actor._tick)
    assert "get_reserved_resources" in inspect.getsource(ElasticScalingPolicy._get_reserved_resources)


def test_the_dashboard_getter_exists():
    from ray._private.worker import get_dashboard_url

    assert callable(get_dashboard_url)
