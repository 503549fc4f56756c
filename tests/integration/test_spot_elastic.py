"""Spot notice -> drain -> just-in-time checkpoint -> node removed -> resume on the workers left.

A real multi-node Ray on one machine (``ray.cluster_utils.Cluster``); the only fake is the
cloud's metadata endpoint, served on 127.0.0.1.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest

from fake_imds import FakeIMDS

from cluster.spot import IMDS, drain_node, watch
from cluster.storage import open_root
from trainers import checkpoint as ckpt
from trainers.config import validate
from trainers.launch import EXIT_OK, run_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture
def two_node_cluster():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()  # this test needs its own multi-node Ray
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": True, "dashboard_host": "127.0.0.1"})
    spot_node = cluster.add_node(num_cpus=1, resources={"spot": 1}, node_ip_address="127.0.0.1")
    ray.init(address=cluster.address)
    yield cluster, spot_node
    ray.shutdown()
    cluster.shutdown()


def test_spot_notice_takes_jit_checkpoint_and_job_resumes_on_survivors(two_node_cluster, tmp_path):
    cluster, spot_node = two_node_cluster
    spec = validate({
        "name": "spot", "training": {"batch_size": 64, "learning_rate": 0.01, "max_steps": 4000},
        "distributed": {"num_workers": {"min": 1, "max": 2}},
        "checkpoint": {"interval": 1000, "storage_root": str(tmp_path)},
        "model": {"hidden_size": 16},
    })
    result: dict = {}
    job = threading.Thread(target=lambda: result.update(zip(("code", "summary"), run_job(spec))))
    job.start()
    run_path = open_root(str(tmp_path)).path("spot", "checkpoints")
    imds = FakeIMDS()
    try:
        time.sleep(20)  # let the 2-worker group start and train
        when = (datetime.now(timezone.utc) + timedelta(seconds=8)).strftime("%Y-%m-%dT%H:%M:%SZ")
        imds.documents["/latest/meta-data/spot/instance-action"] = json.dumps({"action": "terminate", "time": when})
        notice = watch(IMDS(imds.url), lambda n: drain_node(cluster.address, spot_node.node_id, n).returncode == 0,
                       interval_s=0.5, max_polls=10)
        assert notice is not None and notice.kind == "spot-interruption"
        jit = None
        for _ in range(60):
            steps = [ckpt.step_of(d) for d in open_root(run_path).list_dirs()]
            jit = next((s for s in steps if s and s % 1000), None)
            if jit:
                break
            time.sleep(0.5)
        assert jit, "a just-in-time checkpoint off the interval grid must appear"
        cluster.remove_node(spot_node)
    finally:
        job.join(timeout=400)
        imds.close()
    assert result.get("code") == EXIT_OK, result
    summary = result["summary"]
    assert summary["final_step"] == 4000 and summary["world_size"] == 1 and summary["global_batch_size"] == 64
    state = ckpt.load_state(open_root(str(tmp_path)).fs, summary["checkpoint_uri"])
    assert state["global_batch_size"] == 64
