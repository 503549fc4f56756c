"""What `etrain run` prints at the end: the summary a person reads."""

from trainers.cli import print_summary


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
