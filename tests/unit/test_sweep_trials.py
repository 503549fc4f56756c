"""One trial as Tune runs it (trainers.sweep.trials): its job spec, its placement group's record
and removal."""

from __future__ import annotations

from trainers.sweep.trials import trial_job_data


def test_a_trial_reports_every_checkpoint_to_tune_unless_the_sweep_says_otherwise():
    """The scheduler decides at reports: a trial's checkpoints are not coalesced into one report in
    2 s as a job's are. A sweep file that sets the interval keeps it."""
    data = trial_job_data({"checkpoint": {"interval": 10}}, {"training.batch_size": 32}, "trial-a", "/sweeps/s/jobs")
    assert data["checkpoint"] == {"interval": 10, "storage_root": "/sweeps/s/jobs", "report_interval_s": 0}
    assert data["name"] == "trial-a" and data["training"] == {"batch_size": 32}
    kept = trial_job_data({"checkpoint": {"report_interval_s": 5}}, {}, "trial-b", "/j")
    assert kept["checkpoint"]["report_interval_s"] == 5


def test_a_trial_records_its_placement_group_where_the_sweep_driver_finds_it(tmp_path):
    """Tune ends a stopped trial's actor, and its training's driver with it: the sweep's driver
    must find the workers' placement group by the trial alone. A plain run's record stays its own
    (two runs of one job must not remove each other's)."""
    from ray.train import UserCallback

    from cluster.ray_adapter import train_callbacks
    from cluster.storage import open_root
    from trainers import launch
    from trainers.config.loading import validate
    from trainers.job_folder import job_home
    from trainers.sweep import trials

    base = {"name": "s", "checkpoint": {"storage_root": str(tmp_path)}}
    values, jobs_uri = {"training.learning_rate": 0.1}, str(tmp_path / "jobs")
    spec = validate(trial_job_data(base, values, trials.trial_job_name("abc_00001"), jobs_uri))
    runtime = launch.Runtime(use_gpu=False, backend="gloo", mixed_precision="no")
    trial = launch.build_trainer(spec, job_home(spec), runtime, "", None, callbacks=(UserCallback(),))
    jobs = open_root(jobs_uri)
    assert trial.pg_key == train_callbacks.placement_group_record(trials.trial_job_key(jobs, "abc_00001"))
    assert trials.trial_job_key(jobs, "abc_00002") != trials.trial_job_key(jobs, "abc_00001")
    plain = [launch.build_trainer(spec, job_home(spec), runtime, "", None).pg_key for _ in range(2)]
    assert plain[0] != plain[1] and trial.pg_key not in plain


def test_a_trial_placement_group_that_cannot_be_removed_is_said_and_the_sweep_goes_on(tmp_path, monkeypatch, said):
    from cluster.ray_adapter import train_callbacks
    from cluster.storage import open_root
    from trainers.sweep import trials

    def failing(key: bytes) -> None:
        raise RuntimeError("GCS unreachable")

    monkeypatch.setattr(train_callbacks, "remove_recorded_placement_group", failing)
    trials.remove_trial_placement_group(open_root(str(tmp_path / "jobs")), "abc_00001")
    assert said == ["[etrain] note: could not remove trial abc_00001's placement group (RuntimeError: GCS unreachable)"]
