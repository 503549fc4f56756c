"""Spot notice -> drain -> just-in-time checkpoint -> node removed -> resume on the workers left.

A real multi-node Ray on one machine (``ray.cluster_utils.Cluster``); the only fake is the
cloud's metadata endpoint, served on 127.0.0.1.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime, timedelta, timezone

import pytest
from slowpkg import blobs_parquet
from waiting import wait_for

from cluster.ray_adapter.kv import kv_get
from cluster.rehearsal.imds import FakeIMDS
from cluster.spot import IMDS, drain_node, watch
from cluster.storage import open_root
from trainers import checkpoint_files as ckpt
from trainers.config.loading import validate
from trainers.job_folder import job_home
from trainers.launch import EXIT_OK, run_job
from trainers.recovery import Heartbeats

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_spot_notice_takes_jit_checkpoint_and_job_resumes_on_survivors(multi_node, tmp_path):
    import uuid

    from staging import leftover_staging

    cluster, (_, spot_node) = multi_node
    name = f"spot-{uuid.uuid4().hex[:8]}"  # unique: staging copies are recognised by it
    # Each step sleeps 20 ms while the gate file is there: the notice, the `ray drain-node` it runs
    # (seconds on a busy machine) and the just-in-time checkpoint fall inside the run however fast
    # the machine trains; the steps after it run at full speed. The data streams from Parquet.
    gate = tmp_path / "gate"
    gate.touch()
    spec = validate({
        "name": name, "training": {"batch_size": 64, "learning_rate": 0.01, "max_steps": 4000},
        "distributed": {"num_workers": {"min": 1, "max": 2}},
        # One interval checkpoint (at 200; the floor between them is an hour), so any other one
        # before the node goes is the just-in-time one.
        "checkpoint": {"interval": 200, "min_interval_s": 3600, "storage_root": str(tmp_path), "num_to_keep": None},
        "model": {"factory": "slowpkg:busy_model", "options": {"gate": str(gate), "compute_s": 0.02}},
        "data": {"source": blobs_parquet(tmp_path / "blobs.parquet", 3000, group_rows=300)},
    })
    result: dict = {}
    job = threading.Thread(target=lambda: result.update(zip(("code", "summary"), run_job(spec))))
    job.start()
    run_path = open_root(str(tmp_path)).path(name, "checkpoints")
    imds = FakeIMDS()
    try:
        wait_for(lambda: open_root(run_path).list_dirs(), 120, "the 2-worker group's first checkpoint")
        when = (datetime.now(timezone.utc) + timedelta(seconds=8)).strftime("%Y-%m-%dT%H:%M:%SZ")
        imds.documents["/latest/meta-data/spot/instance-action"] = json.dumps({"action": "terminate", "time": when})
        notice = watch(IMDS(imds.url), lambda n: drain_node(cluster.address, spot_node.node_id, n).returncode == 0,
                       interval_s=0.5, max_polls=10)
        assert notice is not None and notice.kind == "spot-interruption"
        steps = lambda: [ckpt.step_of(d) for d in open_root(run_path).list_dirs()]  # noqa: E731
        jit = wait_for(lambda: next((s for s in steps() if s not in (None, 200)), None), 30, "a just-in-time checkpoint")
        # Its folder appears as the upload starts; the node goes once the checkpoint is reported and
        # rank 0 has said why it stops (as a real node goes at the notice's deadline, not before).
        beat = lambda: json.loads(kv_get(Heartbeats(job_home(spec).key, run_id="").key) or b"{}")  # noqa: E731
        wait_for(lambda: beat().get("cause") == "preemption notice" and beat().get("step") == jit, 60,
                 "rank 0's heartbeat after the just-in-time checkpoint")
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
