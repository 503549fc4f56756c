"""The one per-worker training loop Ray Train runs: build the Trainer and run it.

Everything it needs arrives in ``config`` from the launcher (trainers.launch.build_trainer):
the validated spec, where the data and the storage root are, the run folder, ``stop_at_step``,
the resolved mixed precision, and what recovery accounting needs (run id, previous failure).
The loop itself is trainers.trainer.Trainer.train().
"""

from __future__ import annotations

from trainers.trainer import Trainer


def train_loop_per_worker(config: dict) -> None:
    Trainer(config).train()
