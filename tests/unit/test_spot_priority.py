"""Spot first, on-demand when spot cannot be had: Ray's autoscaler v2 scheduler (what `ray up`
runs on AWS) deciding over ray_cluster.yaml's node types, with no cluster.

The node types are read by Ray's own config class from the shipped file, resources filled in
as Ray does from the instance types; the demand is GPU bundles from a job's workers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.autoscaler.v2.instance_manager.config import AutoscalingConfig
from ray.autoscaler.v2.scheduler import ResourceDemandScheduler, SchedulingRequest
from ray.autoscaler.v2.utils import ResourceRequestUtil
from ray.core.generated.autoscaler_pb2 import ResourceRequestByCount

REPO = Path(__file__).resolve().parents[2]


def node_types(priorities: dict[str, int] | None = None):
    aws = yaml.safe_load((REPO / "ray_cluster.yaml").read_text())
    for name, node_type in aws["available_node_types"].items():
        node_type["resources"] = {**node_type["resources"], "CPU": 8, **({"GPU": 1} if name.startswith("gpu") else {})}
        if priorities is not None:
            node_type["priority"] = priorities.get(name, 0)
    config = AutoscalingConfig(aws, skip_content_hash=True)
    return config.get_node_type_configs(), config.get_max_num_nodes()


def launches(gpus: int, failing: dict[str, float] | None = None, priorities: dict[str, int] | None = None) -> dict:
    types, max_nodes = node_types(priorities)
    request = SchedulingRequest(
        disable_launch_config_check=True, node_type_configs=types, max_num_nodes=max_nodes,
        resource_requests=[ResourceRequestByCount(request=ResourceRequestUtil.make({"GPU": 1}), count=gpus)],
        # The v2 autoscaler lowers a type's availability after its launches fail, and lets it recover.
        recoverable_resource_availabilities=failing or {}, cloud_resource_availabilities=failing or {})
    return {launch.instance_type: launch.count for launch in ResourceDemandScheduler(None).schedule(request).to_launch}


@pytest.mark.parametrize("gpus,failing,expected", [
    (1, None, {"gpu_spot": 1}),                                    # spot first
    (4, None, {"gpu_spot": 4}),
    (10, None, {"gpu_spot": 8, "gpu_ondemand": 2}),                # spot at its max_workers: on-demand fills in
    (2, {"gpu_spot": 0.0}, {"gpu_ondemand": 2}),                   # spot launches failing: on-demand
])
def test_spot_first_then_on_demand(gpus, failing, expected):
    assert launches(gpus, failing) == expected


def test_it_is_the_priority_that_puts_spot_first():
    assert launches(1, priorities={"gpu_spot": 1, "gpu_ondemand": 2}) == {"gpu_ondemand": 1}
