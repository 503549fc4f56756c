"""A rank's feed of micro-batches: a DataLoader over chunks of steps, on the device one ahead.

The DataLoader's batch sampler yields chunks of consecutive steps; the dataset's
``__getitems__`` turns a chunk into its micro-batches with array operations (a source's
``fetch``), so a worker process hands over a few large tensors per chunk instead of one
small one per sample. Each fetch also names the row groups of that process's next chunk,
which its source starts reading in the background.

On a GPU, batches come from pinned memory and the next micro-batch is copied on a side
stream while the current one computes. With ``data.num_workers: auto`` the feed measures
the data-wait fraction and moves up the settings of ``autotune`` between steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from trainers.data.autotune import LoaderSetting, ladder, next_setting
from trainers.data.plan import StepMicroBatches


class StepChunks(Sampler[list[int]]):
    """Steps [start, stop) in chunks of ``chunk_steps``: what the loader fetches at a time."""

    def __init__(self, start: int, stop: int, chunk_steps: int):
        self.start, self.stop, self.chunk_steps = start, stop, chunk_steps

    def __iter__(self) -> Iterator[list[int]]:
        for first in range(self.start, self.stop, self.chunk_steps):
            yield list(range(first, min(first + self.chunk_steps, self.stop)))

    def __len__(self) -> int:
        return math.ceil(max(0, self.stop - self.start) / self.chunk_steps)


class StepDataset(Dataset):
    """Map-style view of a source by steps: ``__getitems__(steps)`` gives their micro-batches."""

    def __init__(self, source, steps: StepMicroBatches, stop: int, chunk_steps: int):
        self.source, self.steps, self.stop, self.chunk_steps = source, steps, stop, chunk_steps

    def __len__(self) -> int:
        return len(self.source)

    def __getitems__(self, chunk: list[int]) -> list[dict]:
        mbs = [mb for step in chunk for mb in self.steps.at(step)]
        info = get_worker_info()
        following = chunk[0] + self.chunk_steps * (info.num_workers if info else 1)  # this process's next chunk
        upcoming = [mb for step in range(following, min(following + self.chunk_steps, self.stop))
                    for mb in self.steps.at(step)]
        groups = np.unique(self.source.groups_of(np.concatenate(upcoming))).tolist() if upcoming else []
        return self.source.fetch(np.concatenate(mbs), [len(mb) for mb in mbs], groups)


def _as_is(batch: list[dict]) -> list[dict]:
    """The micro-batches come out of ``__getitems__`` whole: nothing to collate."""
    return batch


def chunk_steps_for(source, steps: StepMicroBatches) -> int:
    """Steps per fetch: about ``chunk_samples`` for this rank, but a chunk never spans more of
    the epoch's order than one shuffle window, so what a fetch holds stays within two windows."""
    plan = steps.plan
    window_samples = plan.window * plan.num_samples / len(plan.group_sizes)
    wanted = math.ceil(source.chunk_samples / max(1, steps.share_size()))
    return max(1, min(wanted, int(window_samples // plan.global_batch)))


class Feed:
    """The micro-batches of steps [start, stop) on one rank, in the plan's order, on ``device``.

    ``tuned`` is the setting an earlier attempt chose with ``auto`` (from its checkpoint);
    ``state()`` gives it back once chosen; ``announce`` (rank 0's print) logs the choice.
    """

    def __init__(self, source, steps: StepMicroBatches, start: int, stop: int, num_workers: int | str,
                 prefetch_factor: int, device: torch.device, tuned: dict | None = None,
                 announce: Callable[[str], None] | None = None):
        self.source, self.steps, self.stop, self.device = source, steps, stop, device
        self.chunk_steps = chunk_steps_for(source, steps)
        self.announce = announce or (lambda line: None)
        self.auto = num_workers == "auto"
        self.options = ladder()
        if self.auto and tuned:
            self.setting = LoaderSetting(tuned["num_workers"], tuned["prefetch_factor"])
        else:
            self.setting = self.options[0] if self.auto else LoaderSetting(int(num_workers), prefetch_factor)
        self.tuning = self.auto and not tuned
        self.tried: list[tuple[LoaderSetting, float]] = []
        self.step, self.index = start, 0  # the next micro-batch handed out
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ahead = None
        self._open(start)

    def state(self) -> dict | None:
        """The loader setting to reuse on resume: the chosen one with ``auto`` (None while tuning)."""
        if not self.auto or self.tuning:
            return None
        return {"num_workers": self.setting.num_workers, "prefetch_factor": self.setting.prefetch_factor}

    def _open(self, step: int) -> None:
        self._ahead = None
        self._items = None  # a multi-process iterator shuts its workers down when dropped
        w = self.setting.num_workers
        if w:
            self.source.release()  # worker processes read and hold their own row groups
        extra = {"prefetch_factor": self.setting.prefetch_factor, "persistent_workers": False} if w else {}
        loader = DataLoader(StepDataset(self.source, self.steps, self.stop, self.chunk_steps),
                            batch_sampler=StepChunks(step, self.stop, self.chunk_steps), num_workers=w,
                            collate_fn=_as_is, pin_memory=self.device.type == "cuda", **extra)
        self._items = (mb for chunk in loader for mb in chunk)
        self.opened_at = step
        self.probe: tuple[int, float, float] | None = None  # (first step, start time, wait so far)
        self.warm_steps = self.chunk_steps * max(1, w)  # the first round of fetches pays for start-up

    def _move(self, batch: dict) -> dict:
        if self.stream is None:
            return batch
        with torch.cuda.stream(self.stream):
            return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}

    def next(self) -> dict:
        """The next micro-batch, on the device (the loop knows how many each step has)."""
        started = time.perf_counter()
        if self.index == 0 and self.tuning:
            self._tune(started)
        batch = self._ahead if self._ahead is not None else self._move(next(self._items))
        self.index += 1
        if self.index == len(self.steps.at(self.step)):
            self.step, self.index = self.step + 1, 0
        self._ahead = self._move(next(self._items)) if self.stream is not None and self.step < self.stop else None
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            for v in batch.values():
                if torch.is_tensor(v):
                    v.record_stream(current)  # its memory is not reused while the step still reads it
        if self.probe is not None:
            first, at, waited = self.probe
            self.probe = (first, at, waited + time.perf_counter() - started)
        return batch

    def _tune(self, now: float) -> None:
        """At a step boundary: start a measurement, or end one and act on ``next_setting``."""
        w = self.setting.num_workers
        probe_steps = max(4, 2 * self.chunk_steps * max(1, w))
        if self.probe is None:
            if self.step >= self.opened_at + self.warm_steps:
                self.probe = (self.step, now, 0.0)
            return
        first, at, waited = self.probe
        if self.step < first + probe_steps:
            return
        wait = waited / max(now - at, 1e-9)
        self.tried.append((self.setting, wait))
        chosen, done = next_setting(self.tried, self.options)
        if done:
            self.tuning = False
            tried = ", ".join(f"{s.num_workers}w/{s.prefetch_factor}p {f:.1%}" for s, f in self.tried)
            self.announce(f"[etrain] data.num_workers auto: {chosen.num_workers} loader workers, prefetch "
                          f"{chosen.prefetch_factor} (data wait by setting: {tried}); kept on resume")
        self.probe = None
        if chosen != self.setting:
            self.setting = chosen
            self._open(self.step)
