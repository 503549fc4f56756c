"""`etrain run` (trainers.cli): a bad spec is refused before Ray, its help teaches, and the summary a
person reads at the end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainers.cli import print_summary

REPO = Path(__file__).resolve().parents[2]


def test_summary_lists_interruptions_and_where_things_are(capsys):
    print_summary({
        "name": "j", "status": "succeeded", "final_step": 50, "target_step": 50, "wall_time_s": 12.5,
        "samples_per_s": 900.0, "final_loss": 0.25, "world_size": 1, "global_batch_size": 64,
        "checkpoint_uri": "s3://b/j/checkpoints/checkpoint_000000050", "storage": "s3://b/j",
        "interruptions": [{"cause": "preemption notice", "step_reached": 30, "steps_lost": 0, "recovery_s": 9.5,
                           "world_size_before": 2, "world_size_after": 1}],
        "error": None,
    })
    out = capsys.readouterr().out
    assert "job j: succeeded at step 50/50" in out and "final loss 0.2500" in out
    assert "interruption: preemption notice at step 30, 0 steps lost, 9.5s to the next step, world size 2 -> 1" in out
    assert "checkpoint: s3://b/j/checkpoints/checkpoint_000000050" in out
    assert "summary:    s3://b/j/summary.json" in out


def test_failed_summary_shows_the_error(capsys):
    print_summary({"name": "j", "status": "failed", "final_step": None, "target_step": 10, "wall_time_s": 3.0,
                   "samples_per_s": None, "final_loss": None, "world_size": None, "global_batch_size": 8,
                   "checkpoint_uri": None, "storage": "/r/j", "interruptions": [], "error": "ValueError: bug"})
    out = capsys.readouterr().out
    assert "job j: failed" in out and "error: ValueError: bug" in out
    assert "checkpoint: None\n" in out  # nothing to resume from: no promise
    print_summary({"name": "j", "status": "failed", "final_step": 20, "target_step": 100, "wall_time_s": 3.0,
                   "samples_per_s": None, "final_loss": 0.5, "world_size": 2, "global_batch_size": 8,
                   "checkpoint_uri": "/r/j/checkpoints/checkpoint_000000020", "storage": "/r/j", "interruptions": [],
                   "error": "ValueError: bug"})
    out = capsys.readouterr().out
    assert "checkpoint: /r/j/checkpoints/checkpoint_000000020 (a re-run resumes from it)" in out, out


@pytest.mark.parametrize("data", [
    {"training": {"optimizer": "Lion"}},
    {"checkpoint": {"path": "../escape_{step}.pt"}},
    {"data": {"factory": "missing_mod:make"}},
])
def test_cli_rejects_without_traceback_ray_or_storage(tmp_path, data):
    root = tmp_path / "root"
    data = {**data, "checkpoint": {**data.get("checkpoint", {}), "storage_root": str(root)}}
    spec = tmp_path / "bad.json"
    spec.write_text(json.dumps(data))
    probe = ("import sys; from trainers.cli import main; code = main(['run', sys.argv[1]]); "
             "print('ray imported:', 'ray' in sys.modules); sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", probe, str(spec)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "invalid job spec" in proc.stderr
    assert "ray imported: False" in proc.stdout, "a bad spec must be refused before Ray is even imported"
    assert not root.exists(), "nothing may be written for a bad spec"


def test_help_teaches():
    proc = subprocess.run([sys.executable, "-m", "trainers.cli", "run", "--help"], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 0
    assert "--stop-at-step" in proc.stdout and "resumes" in proc.stdout
