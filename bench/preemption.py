"""Steps lost and recovery time per interruption, with and without a spot notice, in one run.

On a real multi-node Ray on this machine (``ray.cluster_utils.Cluster``: a head with no
training workers and two 1-CPU "spot" nodes), a 2-worker elastic job is interrupted twice:

1. with a notice: a local IMDSv2 endpoint serves a spot interruption, ``spot-watch`` drains
   the node, the loop takes a just-in-time checkpoint, then the node is removed;
2. without one: the other node is killed outright.

Cold start is the time from submitting the job to its first finished step. Recovery is the
time from the node's removal to the first finished step after it. Targets: <= 1 step lost
with a notice; recovery <= 1.5x cold start.

    python bench/preemption.py [--steps 40000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from tempfile import mkdtemp

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep every address on loopback
REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests" / "fixtures")]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40000, help="target steps of the job (long enough for both)")
    args = parser.parse_args()

    import ray
    from ray.cluster_utils import Cluster
    from waiting import wait_for

    from cluster.log_lines import send_to
    from cluster.ray_adapter.kv import kv_get
    from cluster.rehearsal.imds import FakeIMDS
    from cluster.spot import IMDS, drain_node, watch
    from trainers.config.loading import validate
    from trainers.job_folder import job_home
    from trainers.launch import run_job

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": True, "dashboard_host": "127.0.0.1",
        "dashboard_port": free_port(),  # 8265 may be another Ray's
        "_system_config": {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                           "health_check_failure_threshold": 4}})
    nodes = [cluster.add_node(num_cpus=1, resources={"spot": 1}, node_ip_address="127.0.0.1") for _ in range(2)]
    imds = FakeIMDS()
    try:
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        root = Path(mkdtemp(prefix="etrain-bench-"))
        spec = validate({
            "name": "bench-preempt", "training": {"batch_size": 64, "learning_rate": 0.01, "max_steps": args.steps},
            "distributed": {"num_workers": {"min": 1, "max": 2}, "resize_check_interval_s": 600},
            "checkpoint": {"interval": 500, "storage_root": str(root), "min_interval_s": 2},
            "model": {"hidden_size": 64},
        })
        records_path = root / "bench-preempt" / "interruptions.json"
        records = lambda: json.loads(records_path.read_text()) if records_path.exists() else []  # noqa: E731
        key = f"{job_home(spec).key}/heartbeat".encode()
        result: dict = {}
        submitted = time.time()
        send_to(sys.stderr)  # the job's lines beside the figures, which go to stdout
        job = threading.Thread(target=lambda: result.update(zip(("code", "summary"), run_job(spec))),
                               daemon=True)
        job.start()
        first_step = json.loads(wait_for(lambda: kv_get(key), 300, "the first step"))["time"]
        cold_start_s = first_step - submitted
        time.sleep(3)
        when = (datetime.now(timezone.utc) + timedelta(seconds=6)).strftime("%Y-%m-%dT%H:%M:%SZ")
        imds.documents["/latest/meta-data/spot/instance-action"] = json.dumps({"action": "terminate", "time": when})
        watch(IMDS(imds.url), lambda n: drain_node(cluster.address, nodes[1].node_id, n).returncode == 0,
              interval_s=0.2, max_polls=20)
        wait_for(lambda: (json.loads(kv_get(key) or b"{}").get("cause")), 60, "the JIT checkpoint")
        removed_notice = time.time()
        cluster.remove_node(nodes[1], allow_graceful=False)
        notice = wait_for(lambda: records()[:1], 300, "recovery after the notice")[0]
        time.sleep(3)
        removed_cold = time.time()
        cluster.add_node(num_cpus=1, resources={"spot": 1}, node_ip_address="127.0.0.1")  # room to go on
        cluster.remove_node(nodes[0], allow_graceful=False)
        no_notice = wait_for(lambda: records()[1:2], 300, "recovery after the kill")[0]
        job.join(timeout=1200)
    finally:  # stop everything this bench started, even when a wait above failed
        imds.close()
        ray.shutdown()
        cluster.shutdown()
    recovery_notice = notice["interrupted_at"] + notice["recovery_s"] - removed_notice
    recovery_kill = no_notice["interrupted_at"] + no_notice["recovery_s"] - removed_cold
    print(f"job finished: {result.get('summary', {}).get('status')} at step {result.get('summary', {}).get('final_step')}")
    print(f"cold start (submit to first step): {cold_start_s:.1f} s")
    print(f"steps lost with notice: {notice['steps_lost']}")
    print(f"steps lost without notice: {no_notice['steps_lost']}")
    print(f"recovery with notice: {recovery_notice:.1f} s")
    print(f"recovery without notice: {recovery_kill:.1f} s")
    print(f"recovery over cold start with notice: {recovery_notice / cold_start_s:.2f}")
    print(f"recovery over cold start without notice: {recovery_kill / cold_start_s:.2f}")


if __name__ == "__main__":
    main()
