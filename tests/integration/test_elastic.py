"""Elastic training on a real multi-node Ray on one machine: shrink on node loss, grow back."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from waiting import wait_for

from cluster.storage import open_root
from trainers import checkpoint as ckpt
from trainers.config import validate
from trainers.launch import EXIT_OK, run_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def interruptions(root: Path, job: str) -> list[dict]:
    path = root / job / "interruptions.json"
    return json.loads(path.read_text()) if path.exists() else []


def checkpoints(root: Path, job: str) -> list[int]:
    run = root / job / "checkpoints"
    return sorted(s for p in run.glob("checkpoint_*") if (s := ckpt.step_of(p.name)) is not None) if run.exists() else []


def start(spec) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(zip(("code", "summary"), run_job(spec))), daemon=True)
    thread.start()
    return thread, result


def test_shrinks_on_node_loss_and_grows_back(multi_node, tmp_path):
    cluster, nodes = multi_node
    spec = validate({
        "name": "elastic", "training": {"batch_size": 64, "learning_rate": 0.01, "max_steps": 9000},
        "distributed": {"num_workers": {"min": 1, "max": 2}, "resize_check_interval_s": 3},
        "checkpoint": {"interval": 300, "storage_root": str(tmp_path), "num_to_keep": None},
        "model": {"hidden_size": 256},
    })
    job, result = start(spec)
    wait_for(lambda: checkpoints(tmp_path, "elastic"), 120, "the first checkpoint at 2 workers")
    cluster.remove_node(nodes[1], allow_graceful=False)
    shrunk = wait_for(lambda: [r for r in interruptions(tmp_path, "elastic") if r["world_size_after"] == 1],
                      180, "training to continue on 1 worker")[0]
    assert shrunk["cause"] == "node lost" and shrunk["world_size_before"] == 2
    assert shrunk["steps_lost"] <= 300
    assert shrunk["recovery_s"] < 60, shrunk
    cluster.add_node(num_cpus=1, resources={"spot": 1}, node_ip_address="127.0.0.1")
    grown = wait_for(lambda: [r for r in interruptions(tmp_path, "elastic") if r["world_size_after"] == 2],
                     180, "training to grow back to 2 workers")[0]
    assert grown["cause"] == "scale up" and grown["world_size_before"] == 1
    job.join(timeout=600)
    assert result.get("code") == EXIT_OK, result
    summary = result["summary"]
    assert summary["final_step"] == 9000 == summary["target_step"]
    root = open_root(str(tmp_path))
    sizes = {ckpt.load_state(root.fs, str(tmp_path / "elastic" / "checkpoints" / ckpt.dir_name(s)))["global_batch_size"]
             for s in checkpoints(tmp_path, "elastic")}
    assert sizes == {64}, "the global batch never changes with the world size"
