"""The cluster's nodes and capacity as Ray Train and the autoscaler see them.

- Ray Data's AutoscalingCoordinator: Ray Train's elastic policy sizes a (re)started worker
  group from the node list this actor keeps, refreshed every 20 s. Right after a node is lost
  or drained that list still holds it: the group is planned for a ghost and waits out the
  worker-start timeout. :func:`refresh_cluster_view` makes the actor read the nodes now.
- The most of each resource the autoscaler may bring up, when it reported its node groups to
  the GCS (``use_gpu: auto`` reads it through cluster.capacity): :func:`reported_max_resources`.
"""

from __future__ import annotations

import inspect

REFRESH_REQUESTER = "etrain-refresh"  # owns no request: asking for its reservation only ticks the actor


def _coordinator_refresh_supported() -> None:
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import _AutoscalingCoordinatorActor

    if "recompute" not in inspect.signature(_AutoscalingCoordinatorActor.get_reserved_resources).parameters:
        raise RuntimeError("Ray's AutoscalingCoordinator.get_reserved_resources lost its 'recompute' argument: "
                           "cluster/ray_adapter/cluster_view.py needs another way to refresh Ray Train's node list")


def refresh_cluster_view(timeout_s: float = 10.0) -> None:
    """Have Ray Train's planner see the nodes as they are now (one coordinator tick)."""
    import ray
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import \
        get_or_create_autoscaling_coordinator

    _coordinator_refresh_supported()
    coordinator = get_or_create_autoscaling_coordinator()
    ray.get(coordinator.get_reserved_resources.remote(REFRESH_REQUESTER, recompute=True), timeout=timeout_s)


def reported_max_resources() -> dict[str, float] | None:
    """The most of each resource the autoscaler may bring up, when the autoscaler reported
    its node groups to the GCS (KubeRay, autoscaler v2); None when nothing was reported.

    Ray Train uses the same call (``ray._private.state.state.get_max_resources_from_cluster_config``)
    to refuse a worker group the cluster can never hold.
    """
    import ray._private.state

    found = ray._private.state.state.get_max_resources_from_cluster_config()
    return {k: float(v) for k, v in found.items()} if found else None
