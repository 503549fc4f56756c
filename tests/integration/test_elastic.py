"""Elastic training on a real multi-node Ray on one machine: shrink on node loss, grow back,
and across both every sample of every epoch is trained on exactly once."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from slowpkg import blobs_parquet
from waiting import wait_for

from trainers import checkpoint_files as ckpt
from trainers.config.loading import validate
from trainers.job_folder import job_home
from trainers.launch import EXIT_STOPPED, run_job
from trainers.recovery import StopFlag
from trainers.rules import plan_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]
SAMPLES = 1793  # 28 batches of 64 and a 1-sample tail: the plan must not depend on the worker range


def interruptions(root: Path, job: str) -> list[dict]:
    path = root / job / "interruptions.json"
    return json.loads(path.read_text()) if path.exists() else []


def checkpoints(root: Path, job: str) -> list[int]:
    run = root / job / "checkpoints"
    return sorted(s for p in run.glob("checkpoint_*") if (s := ckpt.step_of(p.name)) is not None) if run.exists() else []


def test_shrinks_on_node_loss_and_grows_back_with_every_sample_once(multi_node, tmp_path):
    """data.record_sample_ids on a Parquet set streamed by row group: 2 workers, a node lost
    mid-epoch, 1 worker from the newest checkpoint, 2 again; the checkpoints' records prove each
    epoch's samples trained exactly once, and the parameters equal those of an unbroken 2-worker
    run to the same step (which a skipped or repeated sample would change)."""
    import pyarrow.fs as pafs
    import torch

    from trainers.data import accounting

    cluster, nodes = multi_node
    blobs_parquet(tmp_path / "blobs.parquet", SAMPLES, group_rows=100)
    gate = tmp_path / "gate"
    gate.touch()
    spec_of = lambda name, workers: validate({  # noqa: E731
        "name": name, "training": {"batch_size": 64, "learning_rate": 0.05, "max_steps": 1_000_000},
        "distributed": {"num_workers": workers, "resize_check_interval_s": 3},
        "checkpoint": {"interval": 25, "storage_root": str(tmp_path), "num_to_keep": None, "min_interval_s": 2},
        # userpkg's make_model(hidden=16), waiting 10 ms a step while the gate is there: the job runs
        # until the test stops it, and leaves the machine to the node starts meanwhile; the unbroken
        # reference runs after the gate is gone, at full speed
        "model": {"factory": "slowpkg:busy_model", "options": {"compute_s": 0.01, "gate": str(gate)}},
        "data": {"source": str(tmp_path / "blobs.parquet"), "shuffle_window_row_groups": 3,
                 "record_sample_ids": True},
    })
    spec = spec_of("streamed", {"min": 1, "max": 2})
    result: dict = {}
    job = threading.Thread(target=lambda: result.update(zip(("code", "summary"), run_job(spec))), daemon=True)
    job.start()
    try:
        wait_for(lambda: checkpoints(tmp_path, "streamed"), 300, "the first checkpoint at 2 workers")
        cluster.remove_node(nodes[1], allow_graceful=False)
        shrunk = wait_for(lambda: [r for r in interruptions(tmp_path, "streamed") if r["world_size_after"] == 1],
                          300, "training to continue on 1 worker")[0]
        assert shrunk["cause"] == "node lost" and shrunk["world_size_before"] == 2
        run = tmp_path / "streamed" / "checkpoints"
        before = [s for s in checkpoints(tmp_path, "streamed") if (m := run / ckpt.dir_name(s) / "manifest.json").exists()
                  and json.loads(m.read_text())["created_at"] <= shrunk["interrupted_at"]]
        assert shrunk["restored_step"] in before[-2:], "from the newest checkpoint (or the one before: uploading)"
        cluster.add_node(num_cpus=1, resources={"spot": 1}, node_ip_address="127.0.0.1")
        grown = wait_for(lambda: [r for r in interruptions(tmp_path, "streamed") if r["world_size_after"] == 2],
                         300, "training to grow back to 2 workers")[0]
        assert grown["cause"] == "scale up" and grown["world_size_before"] == 1
        # Ray Train waited for the group's checkpoint before it restarted it to grow (CheckpointBeforeResize)
        assert grown["steps_lost"] == 0 and grown["restored_step"] == grown["step_reached"], grown
    finally:
        StopFlag(job_home(spec).key).request()
        job.join(timeout=300)
        gate.unlink()
    assert result.get("code") == EXIT_STOPPED, result
    final = result["summary"]["final_step"]
    assert [r["world_size_after"] for r in interruptions(tmp_path, "streamed")] == [1, 2]

    fs = pafs.LocalFileSystem()
    # A resize restarts the group: a checkpoint it caught mid-write stays a folder without a manifest,
    # which restores skip (and name); the complete ones hold every step trained.
    states = [ckpt.load_state(fs, str(run / ckpt.dir_name(s))) for s in checkpoints(tmp_path, "streamed")
              if (run / ckpt.dir_name(s) / ckpt.MANIFEST).exists()]
    by_step = accounting.trained_by_step(s["sample_ids"] for s in states)
    assert sorted(by_step) == list(range(final))
    assert {s["sample_ids"]["world_size"] for s in states} == {1, 2}, "records from both world sizes"
    steps_per_epoch = plan_for(spec, range(SAMPLES)).steps_per_epoch
    assert final >= 2 * steps_per_epoch, (final, steps_per_epoch)
    assert accounting.epoch_problems(by_step, steps_per_epoch, SAMPLES) == []

    code, summary = run_job(spec_of("unbroken", 2), stop_at_step=final)
    assert code == EXIT_STOPPED and summary["final_step"] == final, summary  # stopped at the step asked
    unbroken = ckpt.load_state(fs, str(tmp_path / "unbroken" / "checkpoints" / ckpt.dir_name(final)))["model"]
    resized = next(s for s in states if s["step"] == final)["model"]
    for name, value in unbroken.items():
        torch.testing.assert_close(resized[name], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
