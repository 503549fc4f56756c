"""Ray Tune: what its variant generator acts on, a trial's actor, and its own knobs.

- The one-key mappings Ray Tune's variant generator acts on inside a search space's values
  (``ray.tune.search.variant_generator``: ``{"eval": "<python>"}`` runs, ``{"grid_search": [...]}``
  expands into trials), at any depth: :data:`TUNE_EXPRESSION_KEYS`. A sweep's listed values go to
  Tune as indices, and a value holding one of these is refused besides (trainers.sweep).
- The actor a trial runs in (``Trial.temporary_state.ray_actor``, not public) and the call every
  actor answers once it is up (``__ray_ready__``): the sweep's driver asks an ended trial's actor
  whether it is gone (:func:`trial_actor`, :func:`actor_ready`).
- How often Tune saves the experiment's state (``TUNE_GLOBAL_CHECKPOINT_S``, read by its
  controller): :func:`checkpoint_experiment_every`.
"""

from __future__ import annotations

import os

TUNE_EXPRESSION_KEYS = ("eval", "grid_search")
GLOBAL_CHECKPOINT_ENV = "TUNE_GLOBAL_CHECKPOINT_S"  # ray.tune.constants.TUNE_ENV_VARS


def checkpoint_experiment_every(period_s: int) -> None:
    """Have Tune save its trial states at least every ``period_s`` (a killed driver loses at most that
    much), unless the user chose a period."""
    os.environ.setdefault(GLOBAL_CHECKPOINT_ENV, str(period_s))


def trial_actor(trial):
    """The actor ``trial`` runs in, or None when it has none (never started, or ended)."""
    return trial.temporary_state.ray_actor


def actor_ready(actor):
    """An object ref that resolves once ``actor`` is up, and fails once it is gone (RayActorError)."""
    return actor.__ray_ready__.remote()
