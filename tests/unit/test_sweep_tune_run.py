"""The sweep's Tune wiring (trainers.sweep.tune_run): the space as Tune's domains, listed values as
indices, the searcher."""

from __future__ import annotations

import json

from trainers.sweep.tune_run import tune_space


def test_tune_space_maps_each_domain():
    from ray.tune.search.sample import Categorical, Float, Integer

    plan_space = {"training.batch_size": {"choice": [32, 64]}, "training.learning_rate": {"loguniform": [1e-4, 1e-1]},
                  "data.num_workers": {"randint": [0, 2]}, "training.seed": {"grid": [1, 2]}}
    from trainers.sweep.spec import SweepConfig

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

    from trainers.sweep.spec import SweepConfig
    from trainers.sweep.trials import trial_values

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


def test_optuna_suggests_values_inside_the_space():
    from trainers.sweep.spec import SweepConfig
    from trainers.sweep.trials import trial_values
    from trainers.sweep.tune_run import make_searcher

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


def test_trials_get_pretrained_weights_as_an_absolute_path(tmp_path, monkeypatch):
    """Each trial runs in a directory of its own: a relative model.init_from is read from the sweep's."""
    from trainers.sweep.spec import plan_from_data
    from trainers.sweep.tune_run import trials_base

    monkeypatch.chdir(tmp_path)
    plan = plan_from_data({"model": {"init_from": "w.pt", "hidden_size": 8},
                           "sweep": {"space": {"training.seed": {"choice": [1, 2]}}}}, "sweep")
    assert trials_base(plan)["model"] == {"init_from": str(tmp_path / "w.pt"), "hidden_size": 8}
    assert plan.base["model"]["init_from"] == "w.pt"
