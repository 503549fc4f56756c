"""The spec's cost section: what an instance costs per hour, so a job can report what it spent."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainers.config.fields import Strict

# Illustrative us-west-2 list prices (USD per hour); set your own in the spec's cost section.
DEFAULT_PRICES = {
    "g5.2xlarge": {"on_demand": 1.212, "spot": 0.485},
    "p4d.24xlarge": {"on_demand": 32.77, "spot": 9.83},
    "p5.48xlarge": {"on_demand": 98.32, "spot": 39.33},
    "m6i.2xlarge": {"on_demand": 0.384, "spot": 0.154},
}


class CostConfig(Strict):
    prices_per_hour: dict[str, dict[Literal["on_demand", "spot"], float]] = Field(
        default_factory=lambda: dict(DEFAULT_PRICES),
        description="instance type -> {on_demand, spot} USD per hour; nodes say their type with an "
                    "'instance_<type>' resource (see ray_cluster.yaml)")
