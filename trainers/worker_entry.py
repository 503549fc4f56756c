"""The one per-worker training loop Ray Train runs: build the Trainer and run it.

Everything it needs arrives in ``config`` from the launcher (trainers.launch.build_trainer):
the validated spec, where the data and the storage root are, the run folder, ``stop_at_step``,
the resolved mixed precision, and what recovery accounting needs (run id, previous failure).
The loop itself is trainers.worker_loop.Trainer.train(), imported here on the worker: the driver
names this function to Ray Train without importing torch.
"""

from __future__ import annotations


def train_loop_per_worker(config: dict) -> None:
    from trainers.worker_loop import Trainer

    Trainer(config).train()
