"""Data: Parquet read with pyarrow, a resumable plan of global batches, and per-rank loaders.

The plan is the heart of exact resume. For each epoch it fixes, from the seed alone, the
list of GLOBAL batches (lists of sample indices). It depends on the data, the global batch
size and the seed, never on the world size, so a run saved at 4 workers and resumed at 2
continues with the very next global batch: within an epoch every sample is seen exactly
once. The cursor is just ``(epoch, batch index)``; ``position`` is the samples consumed.

A rank's share of a global batch is a contiguous slice; it is cut into micro-batches of a
fixed size, or, with dynamic batching, packed by length under a token budget (the guide's
BucketSampler advice), so padding stays within a bucket of similar lengths.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

BUCKET_BATCHES = 50  # global batches per length-sorted bucket with dynamic batching


@dataclass(frozen=True)
class Cursor:
    """Where training stands in the data: epoch and index of the next global batch in it."""

    epoch: int
    batch_index: int
    position: int  # samples of this epoch already consumed


class BatchPlan:
    """The deterministic list of global batches of each epoch.

    ``lengths`` (one per sample) turns on length bucketing: batches group similar lengths.
    The last, short batch of an epoch is merged into the one before: every step then has at
    least a global batch (so every worker gets samples), and the plan depends on the data,
    the global batch and the seed only, never on how many workers the job may have.
    """

    def __init__(self, num_samples: int, global_batch: int, seed: int, shuffle: bool = True,
                 lengths: Sequence[int] | None = None):
        if num_samples < global_batch:
            raise ValueError(
                f"the data set has {num_samples} samples, fewer than one global batch ({global_batch}): "
                "lower training.batch_size"
            )
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self.lengths = np.asarray(lengths) if lengths is not None else None
        self._epochs: dict[int, tuple[tuple[int, ...], ...]] = {}
        self.steps_per_epoch = len(self.epoch_batches(0))

    def epoch_batches(self, epoch: int) -> tuple[tuple[int, ...], ...]:
        if epoch not in self._epochs:
            if len(self._epochs) >= 2:  # a run only ever looks at this epoch and the next
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = self._make_epoch(epoch)
        return self._epochs[epoch]

    def _make_epoch(self, epoch: int) -> tuple[tuple[int, ...], ...]:
        order = list(range(self.num_samples))
        rng = random.Random(self.seed * 1_000_003 + epoch)
        if self.shuffle:
            rng.shuffle(order)
        b = self.global_batch
        if self.lengths is not None:
            bucket = b * BUCKET_BATCHES
            order = [i for s in range(0, len(order), bucket)
                     for i in sorted(order[s:s + bucket], key=lambda i: (self.lengths[i], i))]
        batches = [order[s:s + b] for s in range(0, len(order), b)]
        if len(batches) > 1 and len(batches[-1]) < b:
            batches[-2].extend(batches.pop())
        if self.lengths is not None and self.shuffle:
            rng.shuffle(batches)
        return tuple(tuple(x) for x in batches)

    def cursor(self, step: int) -> Cursor:
        epoch, index = divmod(step, self.steps_per_epoch)
        consumed = sum(len(x) for x in self.epoch_batches(epoch)[:index])
        return Cursor(epoch=epoch, batch_index=index, position=consumed)

    def global_batch_at(self, step: int) -> tuple[int, ...]:
        epoch, index = divmod(step, self.steps_per_epoch)
        return self.epoch_batches(epoch)[index]


def rank_share(batch: Sequence[int], rank: int, world_size: int) -> list[int]:
    """The contiguous slice of a global batch that one rank trains on (sizes differ by <= 1)."""
    n = len(batch)
    start = rank * n // world_size
    stop = (rank + 1) * n // world_size
    return list(batch[start:stop])


def micro_batches(share: list[int], micro_batch_size: int, lengths: np.ndarray | None = None,
                  max_tokens: int | None = None) -> list[list[int]]:
    """Cut a rank's share into micro-batches: fixed size, or by length under a token budget.

    Under a budget a micro-batch of n sequences padded to length L costs n * L tokens.
    """
    if lengths is None or max_tokens is None:
        return [share[i:i + micro_batch_size] for i in range(0, len(share), micro_batch_size)]
    out: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in sorted(share, key=lambda i: (lengths[i], i)):
        longest_with = max(longest, int(lengths[i]))
        if current and longest_with * (len(current) + 1) > max_tokens:
            out.append(current)
            current, longest_with = [], int(lengths[i])
        current.append(i)
        longest = longest_with
    if current:
        out.append(current)
    return out


def padding_fraction(batches: list[list[int]], lengths: np.ndarray) -> float:
    """Padded tokens over all tokens computed, for micro-batches padded to their longest."""
    padded = real = 0
    for mb in batches:
        ls = lengths[mb]
        padded += int(ls.max()) * len(mb)
        real += int(ls.sum())
    return 1 - real / padded if padded else 0.0


class StepMicroBatches:
    """A rank's micro-batches for every step in [start, stop): what its loader yields."""

    def __init__(self, plan: BatchPlan, rank: int, world_size: int, micro_batch_size: int,
                 max_tokens: int | None = None):
        self.plan, self.rank, self.world_size = plan, rank, world_size
        self.micro_batch_size, self.max_tokens = micro_batch_size, max_tokens
        self._recent: dict[int, list[list[int]]] = {}

    def at(self, step: int) -> list[list[int]]:
        """Memoised for a few steps: the loader's sampler and the loop both ask for each step."""
        if step not in self._recent:
            if len(self._recent) >= 8:
                self._recent.pop(next(iter(self._recent)))
            share = rank_share(self.plan.global_batch_at(step), self.rank, self.world_size)
            lengths = self.plan.lengths if self.max_tokens else None
            self._recent[step] = micro_batches(share, self.micro_batch_size, lengths, self.max_tokens)
        return self._recent[step]


class PlanSampler(Sampler[list[int]]):
    """Batch sampler over steps [start, stop): feeds a DataLoader in exactly the plan's order."""

    def __init__(self, steps: StepMicroBatches, start: int, stop: int):
        self.steps, self.start, self.stop = steps, start, stop

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start, self.stop):
            yield from self.steps.at(step)

    def __len__(self) -> int:
        return sum(len(self.steps.at(s)) for s in range(self.start, self.stop))


# ---------------------------------------------------------------- Parquet data sets


def read_table(uri: str, filesystem=None) -> pa.Table:
    """Read a Parquet file or folder from a local path or s3:// URI."""
    if filesystem is None and uri.startswith("s3://"):
        from cluster.storage import s3_filesystem

        filesystem, uri = s3_filesystem(), uri.removeprefix("s3://")
    return pq.read_table(uri, filesystem=filesystem)


class FeatureDataset(Dataset):
    """Rows of ``features`` (list of floats) and ``label`` (int), held in memory as tensors."""

    def __init__(self, table: pa.Table):
        missing = {"features", "label"} - set(table.column_names)
        if missing:
            raise ValueError(f"Parquet data lacks columns {sorted(missing)}: a classification set needs "
                             "'features' (list of floats) and 'label' (int)")
        self.x = torch.tensor(np.stack(table.column("features").to_numpy(zero_copy_only=False)), dtype=torch.float32)
        self.y = torch.tensor(table.column("label").to_numpy(), dtype=torch.long)
        self.lengths = None

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]

    def collate(self, items):
        xs, ys = zip(*items)
        return {"x": torch.stack(xs), "y": torch.stack(ys)}


class TokenDataset(Dataset):
    """Variable-length token sequences (column ``tokens``), padded per micro-batch only."""

    def __init__(self, table: pa.Table, pad_id: int, max_len: int):
        if "tokens" not in table.column_names:
            raise ValueError("Parquet data lacks column 'tokens': a language-model set needs a list<int> column")
        self.seqs = [np.asarray(s[:max_len], dtype=np.int64) for s in table.column("tokens").to_pylist()]
        self.lengths = np.array([len(s) for s in self.seqs])
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int):
        return self.seqs[i]

    def collate(self, items):
        longest = max(len(s) for s in items)
        out = torch.full((len(items), longest), self.pad_id, dtype=torch.long)
        for row, s in enumerate(items):
            out[row, :len(s)] = torch.from_numpy(s)
        return {"tokens": out, "num_tokens": int(sum(len(s) for s in items))}


def make_loader(dataset: Dataset, sampler: PlanSampler, num_workers: int, prefetch_factor: int,
                collate=None) -> DataLoader:
    """A DataLoader that honours the spec's worker options (Ray's prepare_data_loader drops some)."""
    kwargs = {}
    if num_workers > 0:
        kwargs = {"persistent_workers": False, "prefetch_factor": prefetch_factor}
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                      collate_fn=collate or getattr(dataset, "collate", None), **kwargs)
