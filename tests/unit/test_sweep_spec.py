"""Sweep files (trainers.sweep.spec): checked up front, every problem with its field path."""

from __future__ import annotations

from pathlib import Path

import pytest
from sweep_files import write_sweep

from trainers.config.errors import SpecError
from trainers.sweep.spec import load_sweep, trial_spec_data

REPO = Path(__file__).resolve().parents[2]


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


def test_trial_values_never_touch_the_base():
    base = {"training": {"batch_size": 64}}
    data = trial_spec_data(base, {"training.batch_size": 32, "data.num_workers": 2})
    assert data == {"training": {"batch_size": 32}, "data": {"num_workers": 2}}
    assert base == {"training": {"batch_size": 64}}


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
