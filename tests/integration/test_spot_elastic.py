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

from cluster.rehearsal.imds import FakeIMDS

from cluster.spot import IMDS, drain_node, watch
from cluster.storage import open_root
from trainers import checkpoint as ckpt
from trainers.config import validate
from trainers.launch import EXIT_OK, run_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_spot_notice_takes_jit_checkpoint_and_job_resumes_on_survivors(multi_node, tmp_path):
    import uuid

    from staging import leftover_staging

    cluster, (_, spot_node) = multi_node
    name = f"spot-{uuid.uuid4().hex[:8]}"  # unique: staging copies are recognised by it
    # Steps run at full speed to the first checkpoint, then at 20 ms each while the gate file is
    # there: the notice, the `ray drain-node` it runs (seconds on a busy machine) and the
    # just-in-time checkpoint then fall well inside the run, however fast training goes.
    gate = tmp_path / "gate"
    spec = validate({
        "name": name, "training": {"batch_size": 64, "learning_rate": 0.01, "max_steps": 4000},
        "distributed": {"num_workers": {"min": 1, "max": 2}},
        "checkpoint": {"interval": 1000, "storage_root": str(tmp_path), "num_to_keep": None},
        "model": {"factory": "slowpkg:gated_model", "options": {"gate": str(gate), "compute_s": 0.02}},
        "data": {"factory": "userpkg:make_data", "options": {"n": 3000}},
    })
    result: dict = {}
    job = threading.Thread(target=lambda: result.update(zip(("code", "summary"), run_job(spec))))
    job.start()
    run_path = open_root(str(tmp_path)).path(name, "checkpoints")
    imds = FakeIMDS()
    try:
        for _ in range(240):  # let the 2-worker group start and take its first checkpoint
            if open_root(run_path).list_dirs():
                break
            time.sleep(0.5)
        gate.touch()
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
        gate.unlink()
        cluster.remove_node(spot_node)
    finally:
        gate.unlink(missing_ok=True)
        job.join(timeout=400)
        imds.close()
    assert result.get("code") == EXIT_OK, result
    summary = result["summary"]
    assert summary["final_step"] == 4000 and summary["world_size"] == 1 and summary["global_batch_size"] == 64
    state = ckpt.load_state(open_root(str(tmp_path)).fs, summary["checkpoint_uri"])
    assert state["global_batch_size"] == 64
    (record,) = summary["interruptions"]
    assert record["cause"] == "preemption notice" and record["restored_step"] == jit
    assert record["steps_lost"] <= 1, record
    assert (record["world_size_before"], record["world_size_after"]) == (2, 1)
    assert leftover_staging(name, tmp_path / name / "checkpoints") == [], "async, JIT and final copies all go"
