"""Sweep files: checked up front with the field path; the pure parts of a sweep table-driven."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainers.config import SpecError
from trainers.sweep import best_row, load_sweep, render_table, trial_job_data, trial_spec_data, tune_space

REPO = Path(__file__).resolve().parents[2]


def write_sweep(tmp_path: Path, space: dict, **sweep) -> Path:
    p = tmp_path / "sw.yaml"
    p.write_text(yaml.safe_dump({
        "name": "sw", "training": {"batch_size": 64, "max_steps": 10},
        "distributed": {"num_workers": 2}, "checkpoint": {"storage_root": str(tmp_path / "st")},
        "sweep": {"space": space, **sweep}}))
    return p


def problems_of(tmp_path, space, **sweep) -> list[str]:
    with pytest.raises(SpecError) as err:
        load_sweep(write_sweep(tmp_path, space, **sweep))
    return err.value.problems


def test_example_sweep_loads_over_its_base():
    plan = load_sweep(REPO / "configs" / "sweep.yaml")
    assert plan.name == "quickstart-sweep"
    assert plan.spec.model.name == "mlp" and plan.spec.training.epochs == 5  # from quickstart.yaml
    assert plan.spec.training.max_steps == 60 and plan.spec.checkpoint.interval == 10  # the sweep file's own
    assert plan.spec.distributed.num_workers == 1  # workers_per_trial
    assert set(plan.sweep.space) == {"training.batch_size", "training.learning_rate", "data.num_workers"}


BAD_SPACES = [
    ({"training.batch_size": {"choice": []}}, {}, "sweep.space.training.batch_size.choice: []: empty"),
    ({"training.learning_rate": {"uniform": [0.1, 0.01]}}, {},
     "sweep.space.training.learning_rate.uniform: [0.1, 0.01]: low > high: swap them"),
    ({"training.learning_rate": {"loguniform": [0, 0.1]}}, {}, "log-uniform needs low > 0"),
    ({"training.batch_sise": {"choice": [32]}}, {},
     "sweep.space.training.batch_sise: unknown key: no 'batch_sise' in training: valid keys there are batch_size"),
    ({"traning.batch_size": {"choice": [32]}}, {}, "no 'traning' in the job spec"),
    ({"training.batch_size.x": {"choice": [32]}}, {}, "training.batch_size is a value, not a section"),
    ({"training.batch_size": {"choose": [32]}}, {}, "expected exactly one of choice, grid, uniform"),
    ({"training.batch_size": {"choice": 32}}, {}, "not a list"),
    ({"training.batch_size": {"randint": [1.5, 8]}}, {}, "randint needs whole numbers"),
    ({"training.learning_rate": {"loguniform": [1e-4, 1e-1]}}, {"search": "grid"},
     "a range cannot be enumerated by search: grid"),
    ({"training.batch_size": {"grid": [32, 64]}}, {"search": "optuna"}, "optuna samples, it does not enumerate"),
    ({"training.batch_size": {"choice": [1, 64]}}, {},
     "sweep.space.training.batch_size: 1 makes the job spec invalid: training.batch_size: 1: smaller than the most workers"),
    ({"training.optimizer": {"choice": ["AdamW", "Lion"]}}, {}, "\"Lion\" makes the job spec invalid"),
    ({"name": {"choice": ["a", "b"]}}, {}, "sweep.space.name: not searchable"),
    ({"labels.tenant": {"choice": ["a", "b"]}}, {}, "sweep.space.labels.tenant: not searchable: labels"),
    ({"labels": {"choice": [{"tenant": "b"}]}}, {}, "sweep.space.labels: not searchable"),
    ({}, {}, "sweep.space: {}: empty"),
    ({"training.batch_size": {"choice": [32]}}, {"metric": "accuracy"}, "sweep.metric: \"accuracy\""),
    ({"training.batch_size": {"choice": [32]}}, {"scheduler": "pbt"}, "sweep.scheduler: \"pbt\""),
    ({"training.batch_size": {"choice": [32]}}, {"num_samples": 0}, "sweep.num_samples: 0: Input should be greater than 0"),
    ({"training.batch_size": {"choice": [32]}}, {"schedular": "asha"}, "sweep.schedular: unknown key: valid keys here are base, space"),
    # every listed value is checked in its trial's spec: a space lists a bounded number in all
    ({"training.seed": {"choice": list(range(300))}}, {},
     "sweep.space.training.seed.choice: 300 values, 300 in the space so far: a space lists at most 256 values in all"),
    ({"training.seed": {"grid": list(range(200))}, "model.options.x": {"choice": list(range(100))}}, {},
     "sweep.space.training.seed.grid: 200 values, 300 in the space so far"),  # keys in file order (sorted)
    ({"model.options.x": {"choice": list(range(255))}, "training.learning_rate": {"uniform": [0.1, 0.2]}}, {},
     "sweep.space.training.learning_rate.uniform: 2 values, 257 in the space so far"),
]


@pytest.mark.parametrize("space,sweep,expected", BAD_SPACES)
def test_bad_sweeps_fail_with_the_path(tmp_path, space, sweep, expected):
    problems = problems_of(tmp_path, space, **sweep)
    assert any(expected in p for p in problems), problems


def test_every_space_problem_is_reported_at_once(tmp_path):
    problems = problems_of(tmp_path, {"training.batch_size": {"choice": []},
                                      "training.learning_rate": {"loguniform": [0, 1]}})
    assert len(problems) == 2


def test_a_file_without_a_sweep_section_says_what_to_do(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("training: {batch_size: 8}\n")
    with pytest.raises(SpecError, match="no 'sweep' section: add one"):
        load_sweep(p)


def test_a_missing_base_names_the_file(tmp_path):
    p = write_sweep(tmp_path, {"training.batch_size": {"choice": [32]}}, base="nope.yaml")
    with pytest.raises(SpecError, match="nope.yaml: cannot read"):
        load_sweep(p)


def test_overrides_apply_to_the_base_job(tmp_path):
    plan = load_sweep(write_sweep(tmp_path, {"training.batch_size": {"choice": [32]}}), ["training.max_steps=3"])
    assert plan.spec.training.max_steps == 3


def test_tune_space_maps_each_domain():
    from ray.tune.search.sample import Categorical, Float, Integer

    plan_space = {"training.batch_size": {"choice": [32, 64]}, "training.learning_rate": {"loguniform": [1e-4, 1e-1]},
                  "data.num_workers": {"randint": [0, 2]}, "training.seed": {"grid": [1, 2]}}
    from trainers.sweep import SweepConfig

    space = tune_space(SweepConfig(space=plan_space))
    assert isinstance(space["training.batch_size"], Categorical)
    assert isinstance(space["training.learning_rate"], Float)
    assert isinstance(space["data.num_workers"], Integer) and space["data.num_workers"].upper == 3  # high included
    assert space["training.seed"] == {"grid_search": [0, 1]}  # listed values go to Tune as indices
    assert space["training.batch_size"].categories == [0, 1]
    grid = tune_space(SweepConfig(space={"training.batch_size": {"choice": [32, 64]}}, search="grid"))
    assert grid["training.batch_size"] == {"grid_search": [0, 1]}


def test_tunes_own_generator_never_sees_a_listed_value(tmp_path):
    """Ray Tune's variant generator runs a one-key {"eval": ...} mapping as Python and expands a
    {"grid_search": [...]} one into more trials, at any depth of a sampled value. The real generator,
    given our space, makes only indices; the trial's values are the listed ones, untouched."""
    from ray.tune.search.variant_generator import generate_variants

    from trainers.sweep import SweepConfig, trial_values

    marker = tmp_path / "pwned"
    evil = {"eval": f"open({str(marker)!r}, 'w').write('x')"}
    listed = [{"x": evil}, {"y": {"grid_search": [1, 2, 3]}}]
    for search in ("random", "grid"):
        sweep = SweepConfig(search=search, space={"model.options": {"choice": listed}})
        configs = [config for _, config in generate_variants(tune_space(sweep))]
        assert not marker.exists()
        assert all(isinstance(c["model.options"], int) for c in configs) and len(configs) <= 2
        assert {json.dumps(trial_values(sweep.space, c)["model.options"]) for c in configs} <= {
            json.dumps(v) for v in listed}
    # What the indices prevent: the same value given to Tune as itself runs the expression.
    list(generate_variants({"model.options": {"choice_value": {"x": evil}}}))
    assert marker.exists(), "Tune no longer evaluates {'eval': ...}: the refusal in space_problems may be relaxed"


def test_trial_values_never_touch_the_base():
    base = {"training": {"batch_size": 64}}
    data = trial_spec_data(base, {"training.batch_size": 32, "data.num_workers": 2})
    assert data == {"training": {"batch_size": 32}, "data": {"num_workers": 2}}
    assert base == {"training": {"batch_size": 64}}


def test_a_trial_reports_every_checkpoint_to_tune_unless_the_sweep_says_otherwise():
    """The scheduler decides at reports: a trial's checkpoints are not coalesced into one report in
    2 s as a job's are. A sweep file that sets the interval keeps it."""
    data = trial_job_data({"checkpoint": {"interval": 10}}, {"training.batch_size": 32}, "trial-a", "/sweeps/s/jobs")
    assert data["checkpoint"] == {"interval": 10, "storage_root": "/sweeps/s/jobs", "report_interval_s": 0}
    assert data["name"] == "trial-a" and data["training"] == {"batch_size": 32}
    kept = trial_job_data({"checkpoint": {"report_interval_s": 5}}, {}, "trial-b", "/j")
    assert kept["checkpoint"]["report_interval_s"] == 5


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


def test_cli_refuses_a_bad_sweep_before_ray(tmp_path):
    p = write_sweep(tmp_path, {"training.batch_size": {"choice": []}})
    proc = subprocess.run([sys.executable, "-m", "trainers.cli", "sweep", str(p)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert "invalid sweep" in proc.stderr and "sweep.space.training.batch_size.choice: []: empty" in proc.stderr
    assert not (tmp_path / "st").exists()  # nothing written


def test_optuna_suggests_values_inside_the_space():
    from trainers.sweep import SweepConfig, make_searcher, trial_values

    sweep = SweepConfig(search="optuna", space={"training.learning_rate": {"loguniform": [1e-4, 1e-2]},
                                                "training.batch_size": {"choice": [32, 64]},
                                                "data.num_workers": {"randint": [0, 2]}})
    searcher = make_searcher(sweep)
    assert searcher.set_search_properties("loss", "min", tune_space(sweep))
    for i in range(5):
        config = searcher.suggest(f"t{i}")
        assert 1e-4 <= config["training.learning_rate"] <= 1e-2
        assert config["training.batch_size"] in (0, 1) and config["data.num_workers"] in (0, 1, 2)
        assert trial_values(sweep.space, config)["training.batch_size"] in (32, 64)
        searcher.on_trial_complete(f"t{i}", {"loss": 1.0 / (i + 1), "training_iteration": 1})


def test_a_trial_that_reached_its_target_before_the_schedulers_stop_is_reported_finished(tmp_path):
    """Trials report in the background while they train on: Tune's last result can be step 40 of 60
    (ASHA's stop on its way) while the job itself finished. The row tells what the job did."""
    from cluster.storage import open_root
    from trainers.sweep import settle_trial_summaries

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
    from trainers.sweep import reached_target, settle_trial_summaries

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


def test_a_trial_records_its_placement_group_where_the_sweep_driver_finds_it(tmp_path):
    """Tune ends a stopped trial's actor, and its training's driver with it: the sweep's driver
    must find the workers' placement group by the trial alone. A plain run's record stays its own
    (two runs of one job must not remove each other's)."""
    from ray.train import UserCallback

    from cluster.ray_adapter import train_callbacks
    from cluster.storage import open_root
    from trainers import launch, sweep
    from trainers.config import validate
    from trainers.home import job_home

    base = {"name": "s", "checkpoint": {"storage_root": str(tmp_path)}}
    values, jobs_uri = {"training.learning_rate": 0.1}, str(tmp_path / "jobs")
    spec = validate(trial_job_data(base, values, sweep.trial_job_name("abc_00001"), jobs_uri))
    runtime = launch.Runtime(use_gpu=False, backend="gloo", mixed_precision="no")
    trial = launch.build_trainer(spec, job_home(spec), runtime, "", None, callbacks=(UserCallback(),))
    jobs = open_root(jobs_uri)
    assert trial.pg_key == train_callbacks.placement_group_record(sweep.trial_job_key(jobs, "abc_00001"))
    assert sweep.trial_job_key(jobs, "abc_00002") != sweep.trial_job_key(jobs, "abc_00001")
    plain = [launch.build_trainer(spec, job_home(spec), runtime, "", None).pg_key for _ in range(2)]
    assert plain[0] != plain[1] and trial.pg_key not in plain


def test_a_trial_placement_group_that_cannot_be_removed_is_said_and_the_sweep_goes_on(tmp_path, monkeypatch):
    from cluster.ray_adapter import train_callbacks
    from cluster.storage import open_root
    from trainers import sweep

    def failing(key: bytes) -> None:
        raise RuntimeError("GCS unreachable")

    monkeypatch.setattr(train_callbacks, "remove_recorded_placement_group", failing)
    said: list[str] = []
    sweep.remove_trial_placement_group(open_root(str(tmp_path / "jobs")), "abc_00001", said.append)
    assert said == ["[etrain] note: could not remove trial abc_00001's placement group (RuntimeError: GCS unreachable)"]


@pytest.mark.parametrize("value, where, reads_as", [
    ({"eval": "__import__('os').system('id')"}, "sweep.space.model.options.choice[1]", "Python to run"),
    ({"x": [{"deep": {"grid_search": [1, 2, 3]}}]}, "sweep.space.model.options.choice[1].x[0].deep", "more trials"),
    ({"a": {"eval": "1", "other": 2}}, "sweep.space.model.options.choice[1].a", "Python to run"),
])
def test_a_listed_value_keyed_like_a_tune_expression_is_refused_wherever_it_sits(tmp_path, value, where, reads_as):
    p = write_sweep(tmp_path, {"model.options": {"choice": [{}, value]}})
    with pytest.raises(SpecError) as err:
        load_sweep(p)
    assert any(line.startswith(where + ": a mapping with the key") and reads_as in line
               for line in err.value.problems), err.value.problems
