"""What a worker reads: a data set as row groups of samples, fetched a whole micro-batch at a time.

A source turns sample ids into micro-batches (dicts of tensors) with array operations on the
row groups' columns: no Python per sample for Parquet data. A user's own map-style Dataset
(``data.factory``) is one in-memory group, fetched through its ``__getitems__`` when it has
one, else item by item, and collated with PyTorch's ``default_collate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import Dataset, default_collate

from trainers.data.parquet import ParquetFiles, RowGroupCache
from trainers.data.plan import group_offsets

CHUNK_SAMPLES = 1024  # samples per loader fetch of Parquet data: amortises a worker's hand-over


class TableSource:
    """A Parquet data set read by row group through a cache that follows the plan."""

    chunk_samples = CHUNK_SAMPLES
    lengths: np.ndarray | None = None

    def __init__(self, files: ParquetFiles, columns: dict[str, str]):
        present = set(files.column_names)
        for field, name in columns.items():
            if name not in present:
                raise ValueError(
                    f"data.columns.{field}: {name!r} is not a column of {files.uri} (it has "
                    f"{', '.join(sorted(present))}): name the right one in data.columns.{field}")
        self.files, self.columns = files, list(columns.values())
        self.group_sizes = files.group_sizes
        self.offsets = group_offsets(files.group_sizes)
        self.cache = RowGroupCache(self._load)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def groups_of(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, ids, side="right") - 1

    def fetch(self, ids: np.ndarray, sizes: Sequence[int], upcoming: Sequence[int]) -> list[dict]:
        """Micro-batches of ``sizes`` samples, in order, for the sample ids ``ids``; then starts
        reading the row groups ``upcoming`` (the next fetch's) in the background."""
        groups = self.groups_of(ids)
        held = self.cache.hold(np.unique(groups).tolist(), upcoming)
        return self.assemble(held, groups, ids - self.offsets[groups], sizes)

    def release(self) -> None:
        self.cache.clear()

    def _load(self, group: int) -> Any:
        return self.decode(self.files.read(group, self.columns))

    def decode(self, table: pa.Table) -> Any:
        raise NotImplementedError

    def assemble(self, held: dict, groups: np.ndarray, local: np.ndarray, sizes: Sequence[int]) -> list[dict]:
        raise NotImplementedError


def _rows(held: dict, groups: np.ndarray, local: np.ndarray, column: int) -> torch.Tensor:
    """Rows ``local`` of each sample's group, in sample order, stacked (one index per group)."""
    present = np.unique(groups)
    if len(present) == 1:
        return held[int(present[0])][column][torch.from_numpy(local)]
    first = held[int(present[0])][column]
    out = torch.empty((len(local), *first.shape[1:]), dtype=first.dtype)
    for g in present:
        where = torch.from_numpy(np.flatnonzero(groups == g))
        out[where] = held[int(g)][column][torch.from_numpy(local[groups == g])]
    return out


class FeatureSource(TableSource):
    """Rows of features (a list of floats, one length) and a label (int classes, float targets)."""

    def __init__(self, files: ParquetFiles, features: str = "features", label: str = "label"):
        super().__init__(files, {"features": features, "label": label})

    def decode(self, table: pa.Table) -> tuple[torch.Tensor, torch.Tensor]:
        col = table.column(0).combine_chunks()
        n = len(col)
        if not pa.types.is_fixed_size_list(col.type):
            widths = pc.list_value_length(col)
            if n and pc.min(widths).as_py() != pc.max(widths).as_py():
                raise ValueError(f"data.columns.features: {self.columns[0]!r} in {self.files.uri} has rows of "
                                 "different lengths: every row needs the same number of features")
        x = torch.from_numpy(col.flatten().to_numpy(zero_copy_only=False).astype(np.float32)).reshape(n, -1)
        labels = table.column(1).to_numpy()
        y = torch.from_numpy(labels.astype(np.int64 if np.issubdtype(labels.dtype, np.integer) else np.float32))
        return x, y

    def assemble(self, held, groups, local, sizes):
        xs = torch.split(_rows(held, groups, local, 0), list(sizes))
        ys = torch.split(_rows(held, groups, local, 1), list(sizes))
        return [{"x": x, "y": y} for x, y in zip(xs, ys)]


class TokenSource(TableSource):
    """Variable-length token sequences (a list of ints), cut to ``max_len``, padded per micro-batch."""

    def __init__(self, files: ParquetFiles, tokens: str, pad_id: int, max_len: int):
        super().__init__(files, {"tokens": tokens})
        self.pad_id, self.max_len = pad_id, max_len
        self.lengths = np.minimum(files.list_lengths(tokens), max_len)

    def decode(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        col = table.column(0).combine_chunks()
        # offsets index ``values`` as stored (also for a sliced array), so the pair stays consistent
        return col.values.to_numpy(zero_copy_only=False).astype(np.int64), col.offsets.to_numpy().astype(np.int64)

    def assemble(self, held, groups, local, sizes):
        lens = np.empty(len(local), dtype=np.int64)
        for g in np.unique(groups):
            here = groups == g
            offsets = held[int(g)][1]
            lens[here] = np.minimum(offsets[local[here] + 1] - offsets[local[here]], self.max_len)
        dest = np.concatenate([[0], np.cumsum(lens)])
        flat = np.empty(int(dest[-1]), dtype=np.int64)
        for g in np.unique(groups):  # every token of the chunk, in sample order, gathered per group
            here = groups == g
            values, offsets = held[int(g)]
            n = lens[here]
            within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
            flat[np.repeat(dest[:-1][here], n) + within] = values[np.repeat(offsets[local[here]], n) + within]
        out, first = [], 0
        for size in sizes:
            ls = lens[first:first + size]
            longest = int(ls.max())
            padded = np.full((size, longest), self.pad_id, dtype=np.int64)
            padded[np.arange(longest)[None, :] < ls[:, None]] = flat[dest[first]:dest[first + size]]
            out.append({"tokens": torch.from_numpy(padded), "num_tokens": int(ls.sum())})
            first += size
        return out


class PairsSource:
    """A user's map-style Dataset of ``(input, target)`` pairs: one group, held by the user's code."""

    chunk_samples = 1  # one step per fetch: a user's per-item code is the cost, spread it over workers

    def __init__(self, inner: Dataset):
        self.inner = inner
        self.lengths = getattr(inner, "lengths", None)
        self.group_sizes = np.array([len(inner)], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.inner)

    def groups_of(self, ids: np.ndarray) -> np.ndarray:
        return np.zeros(len(ids), dtype=np.int64)

    def fetch(self, ids: np.ndarray, sizes: Sequence[int], upcoming: Sequence[int]) -> list[dict]:
        out, first = [], 0
        getitems = getattr(self.inner, "__getitems__", None)
        for size in sizes:
            mb = ids[first:first + size].tolist()
            items = getitems(mb) if getitems else [self.inner[i] for i in mb]
            x, y = default_collate(items)
            out.append({"x": x, "y": y})
            first += size
        return out

    def release(self) -> None:
        """Nothing to drop: the user's dataset lives in memory as it is."""
