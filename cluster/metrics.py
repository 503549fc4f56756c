"""Prometheus metrics of training jobs and of the service, through ``ray.util.metrics``.

Ray exports them from each node's metrics agent (``--metrics-export-port``, pinned to 8080 in
ray_cluster.yaml) with the prefix ``ray_``: ``etrain_loss`` is scraped as ``ray_etrain_loss``.
Job series carry ``job``, ``tenant`` and ``rank`` labels; cost series carry ``instance_type``
and ``market``. ``etrain metrics prometheus-config`` writes a scrape config for a cluster.

Goodput is productive training time (steps that were kept) over wall time since the job was
first submitted. Cost is node-hours by instance type and market times the spec's price table;
savings are what the same node-hours would have cost on demand.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

JOB_TAGS = ("job", "tenant", "rank")
COST_TAGS = ("job", "tenant", "instance_type", "market")
SERVICE_TAGS = ("route", "method", "status")
PROMETHEUS_PREFIX = "ray_"


@dataclass(frozen=True)
class NodeKind:
    instance_type: str
    market: str  # "spot" | "on_demand"


def node_kind(resources: dict[str, float]) -> NodeKind:
    """What a node is, from the custom resources ray_cluster.yaml gives each node type:
    ``spot`` marks the market, ``instance_<type>`` the instance type; anything else is local."""
    types = [k[len("instance_"):] for k in resources if k.startswith("instance_")]
    return NodeKind(instance_type=types[0] if types else "local", market="spot" if "spot" in resources else "on_demand")


def cost_usd(node_hours: float, kind: NodeKind, prices: dict[str, dict[str, float]]) -> tuple[float, float]:
    """(cost, savings against on demand) of ``node_hours`` on one kind of node; unknown types cost 0."""
    price = prices.get(kind.instance_type, {})
    on_demand = price.get("on_demand", 0.0)
    paid = price.get(kind.market, on_demand)
    return node_hours * paid, node_hours * (on_demand - paid)


def goodput(productive_s: float, wall_s: float) -> float:
    """Productive training time over wall time since submit, in [0, 1]."""
    return max(0.0, min(1.0, productive_s / wall_s)) if wall_s > 0 else 0.0


class JobMetrics:
    """The gauges and counters of one training worker; rank 0 also reports the job-level ones."""

    def __init__(self, job: str, tenant: str, rank: int):
        from ray.util.metrics import Gauge

        self.tags = {"job": job, "tenant": tenant or "-", "rank": str(rank)}
        self.cost_tags = {"job": job, "tenant": tenant or "-"}
        g = lambda name, text, tags=JOB_TAGS: Gauge(f"etrain_{name}", text, tag_keys=tags)  # noqa: E731
        self.step_time_s = g("step_time_s", "seconds per optimizer step (mean over the last log interval)")
        self.samples_per_s = g("samples_per_s", "global samples per second")
        self.tokens_per_s = g("tokens_per_s", "global tokens per second (LM workloads)")
        self.loss = g("loss", "training loss (mean over the last log interval)")
        self.learning_rate = g("learning_rate", "learning rate")
        self.data_wait_fraction = g("data_wait_fraction", "share of step time spent waiting on the data loader")
        self.world_size = g("world_size", "training workers in the group")
        self.step = g("step", "optimizer steps done")
        self.checkpoint_save_s = g("checkpoint_save_s", "seconds to write the last checkpoint locally")
        self.checkpoint_upload_s = g("checkpoint_upload_s", "seconds report() blocked for the last checkpoint")
        self.goodput = g("goodput", "productive training time over wall time since submit")
        self.recovery_s = g("recovery_s", "seconds from the last interruption to the next finished step")
        self.gpu_utilization = g("gpu_utilization", "GPU utilisation, 0-1 (NVML)")
        self.gpu_memory_bytes = g("gpu_memory_bytes", "GPU memory allocated by this worker")
        # Job-lifetime totals as gauges, set by rank 0 from the job's interruption records: they
        # start at 0 (a panel has data before the first interruption) and survive restarts.
        self.interruptions = g("interruptions", "interruptions so far (preemption, node lost, user error)")
        self.steps_lost = g("steps_lost", "optimizer steps re-done after interruptions, so far")
        self.cost = Gauge("etrain_cost_usd", "node cost so far, by instance type and market", tag_keys=COST_TAGS)
        self.savings = Gauge("etrain_savings_usd", "saved against all on-demand, by instance type and market",
                             tag_keys=COST_TAGS)
        self.node_hours = Gauge("etrain_node_hours", "node-hours so far, by instance type and market",
                                tag_keys=COST_TAGS)

    def set(self, **values: float) -> None:
        for name, value in values.items():
            if value is not None:
                getattr(self, name).set(float(value), tags=self.tags)

    def interruptions_so_far(self, records: list[dict]) -> None:
        """Totals from the job's interruption records (rank 0, at start and after each one)."""
        self.set(interruptions=len(records), steps_lost=sum(r.get("steps_lost", 0) for r in records),
                 recovery_s=records[-1]["recovery_s"] if records else 0.0)

    def set_cost(self, kind: NodeKind, node_hours: float, cost: float, savings: float) -> None:
        tags = {**self.cost_tags, "instance_type": kind.instance_type, "market": kind.market}
        self.node_hours.set(node_hours, tags=tags)
        self.cost.set(cost, tags=tags)
        self.savings.set(savings, tags=tags)


class ServiceMetrics:
    """Request latency by route and status, and records by state, from the service replica."""

    def __init__(self):
        from ray.util.metrics import Counter, Gauge, Histogram

        self.latency_s = Histogram("etrain_request_seconds", "service request latency", tag_keys=SERVICE_TAGS,
                                   boundaries=[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5])
        self.records = Gauge("etrain_records", "jobs and sweeps by kind and state", tag_keys=("kind", "state"))
        self.reconcile_errors = Counter("etrain_reconcile_errors_total",
                                        "reconciler steps that failed (Ray's Jobs API, the store), by kind",
                                        tag_keys=("kind",))

    def request(self, route: str, method: str, status: int, seconds: float) -> None:
        self.latency_s.observe(seconds, tags={"route": route, "method": method, "status": str(status)})

    def reconcile_error(self, kind: str) -> None:
        self.reconcile_errors.inc(tags={"kind": kind})

    def states(self, counts: dict[tuple[str, str], int]) -> None:
        for (kind, state), n in counts.items():
            self.records.set(float(n), tags={"kind": kind, "state": state})


def scrape_config(targets: list[str], discovery_file: str | None = None, interval_s: float = 15.0) -> str:
    """A prometheus.yml scraping Ray's metrics agents: static targets, plus Ray's own service
    discovery file (written on the head at /tmp/ray/prom_metrics_service_discovery.json)."""
    # honor_labels: our series carry their own `job` label (the training job); without it
    # Prometheus would rename it exported_job in favour of the scrape job's name.
    job: dict = {"job_name": "ray", "scrape_interval": f"{interval_s:g}s", "honor_labels": True}
    if targets:
        job["static_configs"] = [{"targets": sorted(targets)}]
    if discovery_file:
        job["file_sd_configs"] = [{"files": [discovery_file]}]
    return json.dumps({"global": {"scrape_interval": f"{interval_s:g}s"}, "scrape_configs": [job]}, indent=2)
