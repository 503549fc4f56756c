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

from trainers.data.autotune import MIN_PROBE_S, LoaderSetting, ladder, next_setting
from trainers.data.plan import StepMicroBatches
from trainers.data.sources import Stacked


class StepChunks(Sampler[list[int]]):
    """Steps [start, stop) in chunks of ``chunk_steps``: what the loader fetches at a time."""

    def __init__(self, start: int, stop: int, chunk_steps: int):
        self.start, self.stop, self.chunk_steps = start, stop, chunk_steps

    def __iter__(self) -> Iterator[list[int]]:
        for first in range(self.start, self.stop, self.chunk_steps):
            yield list(range(first, min(first + self.chunk_steps, self.stop)))

    def __len__(self) -> int:
        return math.ceil(max(0, self.stop - self.start) / self.chunk_steps)


class SlotRef:
    """A worker's answer when the rows went into a shared-memory slot: which slot, what sizes."""

    def __init__(self, slot: int, sizes: list[int]):
        self.slot, self.sizes = slot, sizes


class StepDataset(Dataset):
    """Map-style view of a source by steps: ``__getitems__(steps)`` gives their micro-batches.

    With ``slots`` (shared-memory tensors made before the workers start, one row per chunk in
    flight) a worker writes a chunk's rows into slot ``chunk % slots`` and hands over only a
    ``SlotRef``: the main process reads the rows where they are, with no copy and no pipe.
    A slot is rewritten only ``len(slots)`` chunks later, after the loop has moved past it.
    """

    def __init__(self, source, steps: StepMicroBatches, start: int, stop: int, chunk_steps: int,
                 slots: dict[str, torch.Tensor] | None = None, with_ids: bool = False):
        self.source, self.steps, self.start, self.stop, self.chunk_steps = source, steps, start, stop, chunk_steps
        self.slots, self.with_ids = slots, with_ids

    def resolve(self, item: tuple) -> Iterator[tuple[dict, bool, np.ndarray | None]]:
        """A fetched chunk's micro-batches, each with whether it ends its step and (``with_ids``)
        the ids of the samples the fetch read for it."""
        payload, per_step, ids = item
        if isinstance(payload, SlotRef):
            n = sum(payload.sizes)
            payload = Stacked({k: v[payload.slot][:n] for k, v in self.slots.items()}, payload.sizes)
        ends = {int(i) - 1 for i in np.cumsum(per_step)}
        for i, mb in enumerate(payload):
            yield mb, i in ends, None if ids is None else ids[i]

    def __len__(self) -> int:
        return len(self.source)

    def __getitems__(self, chunk: list[int]) -> tuple:
        """(the chunk's micro-batches or where they are, how many micro-batches each step has,
        the ids fetched when ``with_ids``)."""
        per_step = [len(self.steps.at(step)) for step in chunk]
        mbs = [mb for step in chunk for mb in self.steps.at(step)]
        info = get_worker_info()
        following = chunk[0] + self.chunk_steps * (info.num_workers if info else 1)  # this process's next chunk
        upcoming = [mb for step in range(following, min(following + self.chunk_steps, self.stop))
                    for mb in self.steps.at(step)]
        groups = self.source.groups_needed(np.concatenate(upcoming)) if upcoming else []
        sizes = [len(mb) for mb in mbs]
        ids = np.concatenate(mbs)
        fetched = mbs if self.with_ids else None
        if self.slots is None:
            return self.source.fetch(ids, sizes, groups), per_step, fetched
        slot = (chunk[0] - self.start) // self.chunk_steps % len(next(iter(self.slots.values())))
        self.source.fetch(ids, sizes, groups, out={k: v[slot] for k, v in self.slots.items()})
        return SlotRef(slot, sizes), per_step, fetched


def _as_is(batch: tuple) -> tuple:
    """The micro-batches come out of ``__getitems__`` whole: nothing to collate."""
    return batch


def chunk_steps_for(source, steps: StepMicroBatches) -> int:
    """Steps per fetch: about ``chunk_samples`` for this rank, but, when the data spans several
    windows, a chunk never spans more of the epoch's order than one shuffle window, so what a
    fetch holds stays within two windows."""
    plan = steps.plan
    wanted = math.ceil(source.chunk_samples / max(1, steps.share_size()))
    if len(plan.group_sizes) <= plan.window:
        return wanted  # one window holds it all
    window_samples = plan.window * plan.num_samples / len(plan.group_sizes)
    return max(1, min(wanted, int(window_samples // plan.global_batch)))


class Feed:
    """The micro-batches of steps [start, stop) on one rank, in the plan's order, on ``device``.

    ``tuned`` is the setting an earlier attempt chose with ``auto`` (from its checkpoint);
    ``state()`` gives it back once chosen; ``announce`` (the worker's logger) logs the choice.
    With ``record_ids`` the feed keeps the ids of the samples it handed out, per step, until
    ``take_record`` (``data.record_sample_ids``, see ``accounting``).
    """

    def __init__(self, source, steps: StepMicroBatches, start: int, stop: int, num_workers: int | str,
                 prefetch_factor: int, device: torch.device, tuned: dict | None = None,
                 announce: Callable[[str], None] | None = None, record_ids: bool = False):
        self.source, self.steps, self.stop, self.device = source, steps, stop, device
        self.record_ids, self.recorded_from, self.recorded = record_ids, start, [[]]
        self.chunk_steps = chunk_steps_for(source, steps)
        self.announce = announce or (lambda line: None)
        self.auto = num_workers == "auto"
        self.options = ladder()
        saved = (LoaderSetting(tuned.get("num_workers"), tuned.get("prefetch_factor"))
                 if self.auto and isinstance(tuned, dict) else None)
        if saved not in self.options:  # a checkpoint is data: only a setting of the ladder is taken from it
            saved = None
        if saved is not None:
            self.setting = saved
        else:
            self.setting = self.options[0] if self.auto else LoaderSetting(int(num_workers), prefetch_factor)
        self.tuning = self.auto and saved is None
        self.tried: list[tuple[LoaderSetting, float]] = []
        self.step, self.index = start, 0  # the next micro-batch handed out
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ahead = None
        self._open(start)

    def take_record(self) -> tuple[int, list[list[int]]]:
        """(the first step recorded, each finished step's sample ids since then); starts anew."""
        first, steps = self.recorded_from, self.recorded[:-1]
        self.recorded_from, self.recorded = self.step, self.recorded[-1:]
        return first, steps

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
        pin = self.device.type == "cuda"
        shapes = self.source.slot_shapes() if w and not pin else None
        slots = None
        if shapes:  # in flight: workers x prefetch; plus the chunk being read and the one before
            count, rows = w * self.setting.prefetch_factor + 2, self.chunk_steps * self.steps.max_share_size()
            slots = {k: torch.empty((count, rows, *shape), dtype=dtype).share_memory_()
                     for k, (shape, dtype) in shapes.items()}
        dataset = StepDataset(self.source, self.steps, step, self.stop, self.chunk_steps, slots, self.record_ids)
        loader = DataLoader(dataset, batch_sampler=StepChunks(step, self.stop, self.chunk_steps), num_workers=w,
                            collate_fn=_as_is, pin_memory=pin, **extra)
        self._items = (pair for chunk in loader for pair in dataset.resolve(chunk))
        self.opened_at = step
        self.probe: tuple[int, float, float] | None = None  # (first step, start time, wait so far)
        self.warm_steps = self.chunk_steps * max(1, w)  # the first round of fetches pays for start-up

    def _pull(self) -> tuple[dict, bool, np.ndarray | None]:
        """The next micro-batch from the loader; on a GPU, its copy to the device is under way."""
        batch, ends_step, ids = next(self._items)
        if self.stream is None:
            return batch, ends_step, ids
        with torch.cuda.stream(self.stream):
            moved = {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        return moved, ends_step, ids

    def next(self) -> dict:
        """The next micro-batch, on the device (the loop knows how many each step has)."""
        started = time.perf_counter()
        if self.index == 0 and self.tuning:
            self._tune(started)
        batch, ends_step, ids = self._ahead if self._ahead is not None else self._pull()
        self.index += 1
        if self.record_ids:
            self.recorded[-1].extend(ids.tolist())
        if ends_step:
            self.step, self.index = self.step + 1, 0
            if self.record_ids:
                self.recorded.append([])
        self._ahead = self._pull() if self.stream is not None and self.step < self.stop else None
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
        if self.step < first + probe_steps or now - at < MIN_PROBE_S:
            return
        wait = waited / max(now - at, 1e-9)
        self.tried.append((self.setting, wait))
        chosen, done = next_setting(self.tried, self.options)
        if done:
            self.tuning = False
            tried = ", ".join(f"{s.num_workers}w/{s.prefetch_factor}p {f:.1%}" for s, f in self.tried)
            self.announce(f"data.num_workers auto: {chosen.num_workers} loader workers, prefetch "
                          f"{chosen.prefetch_factor} (data wait by setting: {tried}); kept on resume")
        self.probe = None
        if chosen != self.setting:
            self.setting = chosen
            self._open(self.step)
