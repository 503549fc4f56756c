"""Latency of the job service next to Ray's own Jobs API, side by side in one run.

A local Ray and the service (Ray Serve on 127.0.0.1) are started; submit and get are timed
through the service (HTTP, bearer token, records in storage) and directly on Ray's
``JobSubmissionClient``, with 1 and with 16 concurrent clients. Every submitted job asks
for a Ray resource no node has, so it waits in PENDING and no training competes with the
measurement; both paths submit the same way.

Targets: p50 overhead (service minus direct) <= 10 ms; p99 <= 4x p50 at 16 clients.

    python bench/service.py [--calls 40]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from tempfile import mkdtemp

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep every address on loopback
NEVER = {"bench_never_present": 1.0}
TOKEN = "bench-token-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def run_clients(clients: int, calls: int, make_call) -> list[float]:
    """``clients`` threads each making ``calls`` calls; every call's latency in ms."""
    def one_client(_):
        call = make_call()
        return [timed(call) for _ in range(calls)]
    with ThreadPoolExecutor(clients) as pool:
        return [ms for chunk in pool.map(one_client, range(clients)) for ms in chunk]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=40, help="calls per client per measurement")
    args = parser.parse_args()

    import ray
    import requests
    from ray import serve
    from ray.job_submission import JobSubmissionClient

    from cluster.ray_adapter.dashboard import dashboard_url
    from service.auth import TokenEntry
    from service.deployment import JobService
    from service.jobs import ServiceSettings

    root = mkdtemp(prefix="etrain-bench-service-")
    ray.init(address="local", num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=True,
             dashboard_host="127.0.0.1", configure_logging=True, logging_level="WARNING", log_to_driver=False)
    try:
        dashboard = dashboard_url()
        settings = ServiceSettings(storage_root=root, state_dir=mkdtemp(prefix="etrain-bench-state-"),
                                   ray_dashboard_url=dashboard, max_active_per_tenant=100000,
                                   entrypoint_resources=NEVER, reconcile_interval_s=3600)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(JobService.bind(settings.model_dump(),
                                  [TokenEntry(tenant="bench", role="user", token=TOKEN).model_dump(exclude={"token"})]),
                  name="etrain", route_prefix="/")
        url, headers = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {TOKEN}"}
        spec = {"name": "bench", "training": {"max_steps": 5}, "distributed": {"num_workers": 1}}
        seed = requests.post(f"{url}/v1/jobs", json=spec, headers=headers, timeout=60).json()
        direct_seed = JobSubmissionClient(dashboard).submit_job(entrypoint="true", entrypoint_resources=NEVER)

        def service_submit():
            s = requests.Session()
            return lambda: s.post(f"{url}/v1/jobs", json=spec, timeout=60,
                                  headers={**headers, "Idempotency-Key": uuid.uuid4().hex}).raise_for_status()

        def direct_submit():
            c = JobSubmissionClient(dashboard)
            return lambda: c.submit_job(entrypoint=f"{sys.executable} -m trainers.train spec.json",
                                        entrypoint_resources=NEVER)

        def service_get():
            s = requests.Session()
            return lambda: s.get(f"{url}/v1/jobs/{seed['id']}", headers=headers, timeout=60).raise_for_status()

        def direct_get():
            c = JobSubmissionClient(dashboard)
            return lambda: c.get_job_info(direct_seed)

        figures = {}
        for clients in (1, 16):
            calls = args.calls if clients == 1 else max(5, args.calls // 4)
            for op, ours, theirs in (("submit", service_submit, direct_submit), ("get", service_get, direct_get)):
                run_clients(clients, 2, ours)  # warm both paths up
                run_clients(clients, 2, theirs)
                a, b = run_clients(clients, calls, ours), run_clients(clients, calls, theirs)
                figures[(op, clients)] = (percentile(a, 50), percentile(a, 99), percentile(b, 50), percentile(b, 99))
                print(f"[bench] {op} x{clients}: {len(a)} calls each way", file=sys.stderr)
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    for (op, clients), (p50, p99, d50, d99) in figures.items():
        print(f"{op} p50 with {clients} clients: {p50:.1f} ms (ray jobs direct {d50:.1f} ms)")
        print(f"{op} p99 with {clients} clients: {p99:.1f} ms (ray jobs direct {d99:.1f} ms)")
    for (op, clients), (p50, p99, d50, d99) in figures.items():
        print(f"{op} p50 overhead with {clients} clients: {p50 - d50:.1f} ms")
    for op in ("submit", "get"):
        p50, p99, _, _ = figures[(op, 16)]
        print(f"{op} p99 over p50 with 16 clients: {p99 / p50:.2f}")


if __name__ == "__main__":
    main()
