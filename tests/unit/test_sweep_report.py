"""What a sweep tells at its end (trainers.sweep.report): the best trial, the rows, the table."""

from __future__ import annotations

import pytest

from trainers.sweep.report import best_row, render_table

ROWS = [
    {"trial": "a", "params": {"x": 1}, "status": "finished", "loss": 0.5, "step": 10, "target_step": 10,
     "samples_per_s": 100.0, "time_s": 1.0},
    {"trial": "b", "params": {"x": 2}, "status": "stopped early", "loss": 0.3, "step": 4, "target_step": 10,
     "samples_per_s": 300.0, "time_s": 0.5},
    {"trial": "c", "params": {"x": 3}, "status": "error", "loss": 0.1, "step": 2, "target_step": 10,
     "samples_per_s": None, "time_s": 0.2},
    {"trial": "d", "params": {"x": 4}, "status": "finished", "loss": float("nan"), "step": 10, "target_step": 10,
     "samples_per_s": 50.0, "time_s": 1.0},
]


@pytest.mark.parametrize("metric,mode,expected", [("loss", "min", "b"), ("loss", "max", "a"),
                                                  ("samples_per_s", "max", "b"), ("samples_per_s", "min", "d")])
def test_best_row_ignores_errors_and_nan(metric, mode, expected):
    assert best_row(ROWS, metric, mode)["trial"] == expected


def test_no_scored_trial_means_no_best():
    assert best_row([ROWS[2]], "loss", "min") is None


def test_results_table_has_a_row_per_trial():
    table = render_table({"metric": "loss", "trials": ROWS})
    lines = table.splitlines()
    assert lines[0].split() == ["trial", "x", "status", "step", "loss", "samples/s", "time_s"]
    assert len(lines) == 5 and "stopped early" in lines[2] and "4/10" in lines[2]


def test_a_trial_that_reached_its_target_before_the_schedulers_stop_is_reported_finished(tmp_path):
    """Trials report in the background while they train on: Tune's last result can be step 40 of 60
    (ASHA's stop on its way) while the job itself finished. The row tells what the job did."""
    from cluster.storage import open_root
    from trainers.sweep.report import settle_trial_summaries

    jobs = open_root(str(tmp_path))
    jobs.write_json({"status": "succeeded", "final_step": 60, "target_step": 60, "final_loss": 0.25},
                    "trial-raced", "summary.json")
    rows = [{"trial": "raced", "params": {}, "status": "stopped early", "step": 40, "target_step": 60, "loss": 0.5}]
    settle_trial_summaries(rows, {"name": "s"}, jobs)
    assert rows[0]["status"] == "finished" and rows[0]["step"] == 60 and rows[0]["loss"] == 0.25
    assert rows[0]["scheduler_stop"] == "came after the job reached its target"
    assert best_row(rows, "loss", "min")["loss"] == 0.25


def test_a_trial_torn_down_without_a_checkpoint_or_before_its_target_is_not_finished(tmp_path):
    from cluster.storage import open_root
    from trainers.sweep.report import reached_target, settle_trial_summaries

    jobs = open_root(str(tmp_path))
    jobs.write_json({"status": "succeeded", "final_step": None, "target_step": None, "final_loss": None},
                    "trial-empty", "summary.json")
    jobs.write_json({"status": "stopped", "final_step": 40, "target_step": 60, "final_loss": 0.5},
                    "trial-cut", "summary.json")
    rows = [{"trial": t, "params": {}, "status": "stopped early", "step": 40, "target_step": 60, "loss": 0.5}
            for t in ("empty", "cut")]
    settle_trial_summaries(rows, {"name": "s"}, jobs)
    assert [r["status"] for r in rows] == ["stopped early", "stopped early"]
    assert not reached_target({"status": "succeeded", "final_step": None, "target_step": 60})
    assert reached_target({"status": "succeeded", "final_step": 60, "target_step": 60})
