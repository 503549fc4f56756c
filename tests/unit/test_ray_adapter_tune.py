"""The Ray internals cluster/ray_adapter/tune.py relies on are still where it reaches for them.

These run against the installed (pinned) Ray without starting it: an upgrade that moves or
changes one fails here, by name, before a job meets it.
"""

from __future__ import annotations

import inspect
import os
from types import SimpleNamespace

from cluster.ray_adapter import tune


def test_tune_reads_exactly_these_one_key_mappings_in_a_space():
    """The keys a sweep refuses in its listed values are every key Tune's variant generator acts on:
    a Ray that adds one fails here, and the refusal (trainers.sweep) must learn it."""
    import re

    from ray.tune.search import variant_generator

    from cluster.ray_adapter.tune import TUNE_EXPRESSION_KEYS

    source = inspect.getsource(variant_generator)
    acted_on = set(re.findall(r'"(\w+)" in (?:v|domain)\b', source))
    assert acted_on == set(TUNE_EXPRESSION_KEYS), acted_on
    resolved = list(variant_generator.generate_variants({"a": {"grid_search": [1, 2]}, "b": {"eval": "3 * 2"}}))
    assert [config for _, config in resolved] == [{"a": 1, "b": 6}, {"a": 2, "b": 6}]


def test_a_trials_actor_and_the_call_every_actor_answers_are_where_the_sweep_reads_them():
    """The sweep's driver waits for an ended trial's actor to be gone before it removes the trial's
    placement group (trainers.sweep.trial_cleanup_callback): it finds the actor on the trial and asks it."""
    import ray.actor
    from ray.tune.experiment import Trial

    trial = Trial("trainable", stub=True)
    assert tune.trial_actor(trial) is None, "a trial that has not started has no actor"
    trial.temporary_state.ray_actor = "the actor"
    assert tune.trial_actor(trial) == "the actor"
    assert "def __ray_ready__(self)" in inspect.getsource(ray.actor._modify_class), \
        "Ray's actors no longer answer __ray_ready__: actor_ready needs another call"
    asked = []
    actor = SimpleNamespace(__ray_ready__=SimpleNamespace(remote=lambda: asked.append("ready?") or "ref"))
    assert tune.actor_ready(actor) == "ref" and asked == ["ready?"]


def test_tunes_experiment_checkpoint_period_is_read_from_the_variable_set(monkeypatch):
    from ray.tune import constants
    from ray.tune.execution.tune_controller import TuneController

    assert tune.GLOBAL_CHECKPOINT_ENV in constants.TUNE_ENV_VARS
    assert f'os.getenv("{tune.GLOBAL_CHECKPOINT_ENV}", "auto")' in inspect.getsource(TuneController.__init__)
    monkeypatch.delenv(tune.GLOBAL_CHECKPOINT_ENV, raising=False)
    tune.checkpoint_experiment_every(1)
    assert os.environ[tune.GLOBAL_CHECKPOINT_ENV] == "1"
    monkeypatch.setenv(tune.GLOBAL_CHECKPOINT_ENV, "30")
    tune.checkpoint_experiment_every(1)
    assert os.environ[tune.GLOBAL_CHECKPOINT_ENV] == "30", "a user's own period stays"
