"""The plan: which samples every step trains on, as a pure function of the spec.

For each epoch the plan fixes, from the seed alone, the list of GLOBAL batches (arrays of
sample ids). It depends on the data's row-group sizes, the global batch size, the shuffle
window and the seed, never on the world size, so a run saved at 4 workers and resumed at 2
continues with the very next global batch: within an epoch every sample is seen exactly
once. The cursor is just ``(epoch, batch index)``; ``position`` is the samples consumed.

The shuffle streams: each epoch puts the row groups in a new order, then shuffles samples
within windows of ``window`` consecutive row groups. Consecutive steps therefore read from a
few row groups only, so a worker holds a bounded window of the data, never all of it. A
window of every row group is a full shuffle; a window of one keeps each row group's samples
together (cheapest, least mixed).

A rank's share of a global batch is a contiguous slice; it is cut into micro-batches of a
fixed size, or, with dynamic batching, packed by length under a token budget (the guide's
BucketSampler advice), so padding stays within a bucket of similar lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BUCKET_BATCHES = 50  # global batches per length-sorted bucket with dynamic batching


@dataclass(frozen=True)
class Cursor:
    """Where training stands in the data: epoch and index of the next global batch in it."""

    epoch: int
    batch_index: int
    position: int  # samples of this epoch already consumed


def group_offsets(group_sizes: Sequence[int]) -> np.ndarray:
    """First sample id of each row group, and the total at the end."""
    return np.concatenate([[0], np.cumsum(np.asarray(group_sizes, dtype=np.int64))])


def epoch_order(group_sizes: Sequence[int], seed: int, epoch: int, window: int, shuffle: bool = True,
                lengths: np.ndarray | None = None, bucket: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Sample ids of one epoch in training order, and where each window starts in that order.

    Row groups are permuted, then samples shuffled within each window of ``window`` row
    groups; with ``lengths``, each window is then sorted by length in buckets of ``bucket``
    samples so that batches group similar lengths.
    """
    offsets = group_offsets(group_sizes)
    groups = len(offsets) - 1
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(groups) if shuffle else np.arange(groups)
    parts: list[np.ndarray] = []
    for w in range(0, groups, window):
        ids = np.concatenate([np.arange(offsets[g], offsets[g + 1]) for g in order[w:w + window]])
        if shuffle:
            rng.shuffle(ids)
        if lengths is not None and bucket:
            ids = np.concatenate([chunk[np.lexsort((chunk, lengths[chunk]))]
                                  for chunk in np.array_split(ids, range(bucket, len(ids), bucket))])
        parts.append(ids)
    starts = np.cumsum([0] + [len(p) for p in parts[:-1]])
    return np.concatenate(parts), starts


def batch_starts(num_samples: int, global_batch: int) -> np.ndarray:
    """Start of each global batch in the epoch's order, and the end: the short tail joins the
    batch before it, so every step has at least a global batch (every worker gets samples)."""
    starts = list(range(0, num_samples, global_batch))
    if len(starts) > 1 and num_samples % global_batch:
        starts.pop()
    return np.array([*starts, num_samples], dtype=np.int64)


def window_batch_order(starts: np.ndarray, window_starts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Batches shuffled among those that begin in the same window (dynamic batching): the
    length-sorted batches come in a random order while steps still read one window at a time."""
    owner = np.searchsorted(window_starts, starts[:-1], side="right")
    order = np.arange(len(starts) - 1)
    for w in np.unique(owner):
        members = order[owner == w]
        order[owner == w] = rng.permutation(members)
    return order


class BatchPlan:
    """The deterministic list of global batches of each epoch.

    ``group_sizes`` are the data's row groups (one group of everything when it has none);
    ``lengths`` (one per sample) turns on length bucketing: batches group similar lengths.
    """

    def __init__(self, num_samples: int, global_batch: int, seed: int, shuffle: bool = True,
                 lengths: Sequence[int] | None = None, group_sizes: Sequence[int] | None = None,
                 window: int = 4):
        if num_samples < global_batch:
            raise ValueError(
                f"the data set has {num_samples} samples, fewer than one global batch ({global_batch}): "
                "lower training.batch_size"
            )
        self.group_sizes = np.asarray(group_sizes if group_sizes is not None else [num_samples], dtype=np.int64)
        if int(self.group_sizes.sum()) != num_samples:
            raise ValueError(f"row groups hold {int(self.group_sizes.sum())} samples, not {num_samples}")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self.window = window
        self.lengths = np.asarray(lengths) if lengths is not None else None
        self._starts = batch_starts(num_samples, global_batch)
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.steps_per_epoch = len(self._starts) - 1

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(order of sample ids, batch order, samples consumed before each batch index)."""
        if epoch not in self._epochs:
            if len(self._epochs) >= 2:  # a run only ever looks at this epoch and the next
                self._epochs.pop(min(self._epochs))
            bucket = self.global_batch * BUCKET_BATCHES if self.lengths is not None else 0
            order, window_starts = epoch_order(self.group_sizes, self.seed, epoch, self.window, self.shuffle,
                                               self.lengths, bucket)
            batches = np.arange(self.steps_per_epoch)
            if self.lengths is not None and self.shuffle:
                batches = window_batch_order(self._starts, window_starts,
                                             np.random.default_rng([self.seed, epoch, 1]))
            consumed = np.concatenate([[0], np.cumsum(np.diff(self._starts)[batches])])
            self._epochs[epoch] = (order, batches, consumed)
        return self._epochs[epoch]

    def batches(self, epoch: int) -> list[np.ndarray]:
        """Every global batch of ``epoch`` in training order."""
        return [self.global_batch_at(epoch * self.steps_per_epoch + i) for i in range(self.steps_per_epoch)]

    def cursor(self, step: int) -> Cursor:
        epoch, index = divmod(step, self.steps_per_epoch)
        return Cursor(epoch=epoch, batch_index=index, position=int(self._epoch(epoch)[2][index]))

    def global_batch_at(self, step: int) -> np.ndarray:
        epoch, index = divmod(step, self.steps_per_epoch)
        order, batches, _ = self._epoch(epoch)
        b = batches[index]
        return order[self._starts[b]:self._starts[b + 1]]


def rank_share(batch: Sequence[int], rank: int, world_size: int) -> Sequence[int]:
    """The contiguous slice of a global batch that one rank trains on (sizes differ by <= 1)."""
    n = len(batch)
    return batch[rank * n // world_size:(rank + 1) * n // world_size]


def micro_batches(share: Sequence[int], micro_batch_size: int, lengths: np.ndarray | None = None,
                  max_tokens: int | None = None) -> list[np.ndarray]:
    """Cut a rank's share into micro-batches: fixed size, or by length under a token budget.

    Under a budget a micro-batch of n sequences padded to length L costs n * L tokens.
    """
    share = np.asarray(share, dtype=np.int64)
    if lengths is None or max_tokens is None:
        return [share[i:i + micro_batch_size] for i in range(0, len(share), micro_batch_size)]
    ordered = share[np.lexsort((share, lengths[share]))]
    sizes = lengths[ordered]
    out: list[np.ndarray] = []
    first = 0
    for i in range(1, len(ordered)):
        if int(sizes[i]) * (i - first + 1) > max_tokens:  # sorted: the newcomer is the longest
            out.append(ordered[first:i])
            first = i
    out.append(ordered[first:])
    return out


def padding_fraction(batches: Sequence[Sequence[int]], lengths: np.ndarray) -> float:
    """Padded tokens over all tokens computed, for micro-batches padded to their longest."""
    padded = real = 0
    for mb in batches:
        ls = lengths[np.asarray(mb)]
        padded += int(ls.max()) * len(mb)
        real += int(ls.sum())
    return 1 - real / padded if padded else 0.0


class StepMicroBatches:
    """A rank's micro-batches for each step: what its loader fetches and the loop trains on."""

    def __init__(self, plan: BatchPlan, rank: int, world_size: int, micro_batch_size: int,
                 max_tokens: int | None = None):
        self.plan, self.rank, self.world_size = plan, rank, world_size
        self.micro_batch_size, self.max_tokens = micro_batch_size, max_tokens
        self._recent: dict[int, list[np.ndarray]] = {}

    def at(self, step: int) -> list[np.ndarray]:
        """Memoised for a few steps: the loader and the loop both ask for each step."""
        if step not in self._recent:
            if len(self._recent) >= 64:
                self._recent.pop(next(iter(self._recent)))
            share = rank_share(self.plan.global_batch_at(step), self.rank, self.world_size)
            lengths = self.plan.lengths if self.max_tokens else None
            self._recent[step] = micro_batches(share, self.micro_batch_size, lengths, self.max_tokens)
        return self._recent[step]

    def share_size(self) -> int:
        """Samples per step on this rank (the smallest share; tails add a few)."""
        return self.plan.global_batch // self.world_size

    def max_share_size(self) -> int:
        """The most samples a step can give this rank: an epoch's last batch takes the short tail."""
        return -(-(2 * self.plan.global_batch - 1) // self.world_size)
