"""The Ray internals this project touches, behind one module, checked against the pinned Ray.

Ray's public API does not offer these; each function names the internal it uses.
`tests/unit/test_ray_adapter.py` checks each, so an upgrade of Ray that moves or renames
one fails there, loudly, instead of deep in a job. (trainers/recovery.py still calls Ray's
KV store directly here; the `integration` branch moves it and the rest behind this module.)
"""

from __future__ import annotations


def reported_max_resources() -> dict[str, float] | None:
    """The most of each resource the autoscaler may bring up, when the autoscaler reported
    its node groups to the GCS (KubeRay, autoscaler v2); None when nothing was reported.

    Ray Train uses the same call (``ray._private.state.state.get_max_resources_from_cluster_config``)
    to refuse a worker group the cluster can never hold.
    """
    import ray._private.state

    found = ray._private.state.state.get_max_resources_from_cluster_config()
    return {k: float(v) for k, v in found.items()} if found else None
