"""What a worker reads: a data set as row groups of samples, fetched a whole micro-batch at a time.

A source turns sample ids into micro-batches (dicts of tensors) with array operations on the
row groups' columns: no Python per sample for Parquet data. A user's own map-style Dataset
(``data.factory``) is one in-memory group, fetched through its ``__getitems__`` when it has
one, else item by item, and collated with PyTorch's ``default_collate`` (a plain
``TensorDataset`` of two tensors: by indexing its tensors, which gives the same).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from trainers.data.parquet import ParquetFiles, RowGroupCache
from trainers.data.plan import group_offsets

CHUNK_SAMPLES = 4096  # samples per loader fetch of Parquet data: amortises a worker's hand-over
CHUNK_BYTES = 4 * 2**20  # but no more than this much of them (wide rows)


class Stacked:
    """Micro-batches stacked along the first dimension: a worker process hands over one tensor
    per field for a whole fetch (not one per micro-batch); they are split, as views, on arrival."""

    def __init__(self, fields: dict[str, torch.Tensor], sizes: Sequence[int]):
        self.fields, self.sizes = fields, list(sizes)

    def __iter__(self) -> Iterator[dict]:
        parts = {k: torch.split(v, self.sizes) for k, v in self.fields.items()}
        for i in range(len(self.sizes)):
            yield {k: p[i] for k, p in parts.items()}

    def __getstate__(self) -> dict:
        """As NumPy arrays, copied through the loader's pipe: for a fetch's few hundred KiB that is
        faster than PyTorch's shared-memory hand-over, which passes a file descriptor per tensor."""
        return {"fields": {k: v.numpy() for k, v in self.fields.items()}, "sizes": self.sizes}

    def __setstate__(self, state: dict) -> None:
        self.fields = {k: torch.from_numpy(v) for k, v in state["fields"].items()}
        self.sizes = state["sizes"]

    def pin_memory(self) -> Stacked:
        """Called by a DataLoader with ``pin_memory``: page-locked, for non-blocking copies to a GPU."""
        return Stacked({k: v.pin_memory() for k, v in self.fields.items()}, self.sizes)


def single_array(column: pa.ChunkedArray) -> pa.Array:
    """A column as one array; a row group's column is usually one chunk already, taken as it is
    (``combine_chunks`` would copy it: a second row group's worth of memory per read)."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def arrow_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor over Arrow's memory, not a copy of it. The array is read-only and so is the tensor
    in practice: held row groups are only ever indexed into new tensors, never written; PyTorch
    warns about any non-writable array, so that one warning is silenced here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


class TableSource:
    """A Parquet data set read by row group through a cache that follows the plan."""

    lengths: np.ndarray | None = None

    def __init__(self, files: ParquetFiles, columns: dict[str, str]):
        present = set(files.column_names)
        for field, name in columns.items():
            if name not in present:
                raise ValueError(
                    f"data.columns.{field}: {name!r} is not a column of {files.uri} (it has "
                    f"{', '.join(sorted(present))}): name the right one in data.columns.{field}")
        self.files, self.columns = files, list(columns.values())
        self.chunk_samples = max(1, min(CHUNK_SAMPLES, int(CHUNK_BYTES // max(1.0, files.row_bytes))))
        self.group_sizes = files.group_sizes
        self.offsets = group_offsets(files.group_sizes)
        self.cache = RowGroupCache(self._load)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def groups_of(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, ids, side="right") - 1

    def groups_needed(self, ids: np.ndarray) -> list[int]:
        """The row groups that hold ``ids``."""
        return [0] if len(self.offsets) == 2 else np.unique(self.groups_of(ids)).tolist()

    def fetch(self, ids: np.ndarray, sizes: Sequence[int], upcoming: Sequence[int],
              out: dict[str, torch.Tensor] | None = None) -> Iterable[dict]:
        """Micro-batches of ``sizes`` samples, in order, for the sample ids ``ids``; then starts
        reading the row groups ``upcoming`` (the next fetch's) in the background. ``out`` (see
        ``slot_shapes``) receives the rows where a source stacks them."""
        if len(self.offsets) == 2:  # one row group: every id is a row of it
            held = self.cache.hold([0], upcoming)
            return self.assemble(held, [0], np.zeros(len(ids), dtype=np.int64), ids, sizes, out)
        groups = self.groups_of(ids)
        present = np.unique(groups).tolist()
        held = self.cache.hold(present, upcoming)
        return self.assemble(held, present, groups, ids - self.offsets[groups], sizes, out)

    def slot_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]] | None:
        """Per field, the shape and type of one sample, for sources that stack micro-batches into
        shared memory; None for those that do not."""
        return None

    def release(self) -> None:
        self.cache.clear()

    def _load(self, group: int) -> Any:
        return self.decode(self.files.read(group, self.columns))

    def decode(self, table: pa.Table) -> Any:
        raise NotImplementedError

    def assemble(self, held: dict, present: list[int], groups: np.ndarray, local: np.ndarray,
                 sizes: Sequence[int], out: dict[str, torch.Tensor] | None) -> Iterable[dict]:
        """Micro-batches from the held row groups ``present``: sample i is row ``local[i]`` of
        group ``groups[i]``."""
        raise NotImplementedError


def _rows(held: dict, present: list[int], groups: np.ndarray, local: np.ndarray, column: int,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``local`` of each sample's group, in sample order, stacked (one index per group),
    into the first rows of ``out`` when given."""
    first = held[present[0]][column]
    if out is not None:
        out = out[:len(local)]
    if len(present) == 1:
        index = torch.from_numpy(local)
        return first[index] if out is None else torch.index_select(first, 0, index, out=out)
    if out is None:
        out = torch.empty((len(local), *first.shape[1:]), dtype=first.dtype)
    for g in present:
        here = groups == g
        out[torch.from_numpy(np.flatnonzero(here))] = held[g][column][torch.from_numpy(local[here])]
    return out


class FeatureSource(TableSource):
    """Rows of features (a list of floats, one length) and a label (int classes, float targets)."""

    def __init__(self, files: ParquetFiles, features: str = "features", label: str = "label"):
        super().__init__(files, {"features": features, "label": label})

    def decode(self, table: pa.Table) -> tuple[torch.Tensor, torch.Tensor]:
        col = single_array(table.column(0))
        n = len(col)
        if not pa.types.is_fixed_size_list(col.type):
            widths = pc.list_value_length(col)
            if n and pc.min(widths).as_py() != pc.max(widths).as_py():
                raise ValueError(f"data.columns.features: {self.columns[0]!r} in {self.files.uri} has rows of "
                                 "different lengths: every row needs the same number of features")
        x = arrow_tensor(col.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)).reshape(n, -1)
        labels = table.column(1).to_numpy()
        y = torch.from_numpy(labels.astype(np.int64 if np.issubdtype(labels.dtype, np.integer) else np.float32))
        return x, y

    def assemble(self, held, present, groups, local, sizes, out):
        out = out or {}
        return Stacked({"x": _rows(held, present, groups, local, 0, out.get("x")),
                        "y": _rows(held, present, groups, local, 1, out.get("y"))}, sizes)

    def slot_shapes(self):
        x, y = self._load(0)
        return {"x": (tuple(x.shape[1:]), x.dtype), "y": ((), y.dtype)}


class TokenSource(TableSource):
    """Variable-length token sequences (a list of ints), cut to ``max_len``, padded per micro-batch."""

    def __init__(self, files: ParquetFiles, tokens: str, pad_id: int, max_len: int):
        super().__init__(files, {"tokens": tokens})
        self.pad_id, self.max_len = pad_id, max_len
        self.lengths = np.minimum(files.list_lengths(tokens), max_len)

    def decode(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        col = single_array(table.column(0))
        # offsets index ``values`` as stored (also for a sliced array), so the pair stays consistent
        return (col.values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False),
                col.offsets.to_numpy().astype(np.int64))

    def assemble(self, held, present, groups, local, sizes, out):
        lens = np.empty(len(local), dtype=np.int64)
        for g in present:
            here = groups == g
            offsets = held[g][1]
            lens[here] = np.minimum(offsets[local[here] + 1] - offsets[local[here]], self.max_len)
        dest = np.concatenate([[0], np.cumsum(lens)])
        flat = np.empty(int(dest[-1]), dtype=np.int64)
        for g in present:  # every token of the chunk, in sample order, gathered per group
            here = groups == g
            values, offsets = held[g][0], held[g][1]
            n = lens[here]
            within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
            flat[np.repeat(dest[:-1][here], n) + within] = values[np.repeat(offsets[local[here]], n) + within]
        out, first = [], 0
        for size in sizes:
            ls = lens[first:first + size]
            longest = int(ls.max())
            padded = np.full((size, longest), self.pad_id, dtype=np.int64)
            real = np.arange(longest)[None, :] < ls[:, None]
            padded[real] = flat[dest[first]:dest[first + size]]
            out.append(self.micro_batch(padded, real, ls, held, groups[first:first + size], local[first:first + size]))
            first += size
        return out

    def micro_batch(self, padded: np.ndarray, real: np.ndarray, lengths: np.ndarray, held: dict,
                    groups: np.ndarray, local: np.ndarray) -> dict:
        """One micro-batch from its padded rows (``real`` marks the tokens that are not padding)."""
        return {"tokens": torch.from_numpy(padded), "num_tokens": int(lengths.sum())}


class TextSource(TokenSource):
    """Tokenized text for a Hugging Face model (``trainers.data.text``): ``input_ids`` padded per
    micro-batch with their ``attention_mask``, and each row's class in ``labels`` when there is one."""

    def __init__(self, files: ParquetFiles, pad_id: int, max_len: int, label: str | None = None):
        TableSource.__init__(self, files, {"input_ids": "input_ids", **({"label": label} if label else {})})
        self.pad_id, self.max_len, self.label = pad_id, max_len, label
        self.lengths = np.minimum(files.list_lengths("input_ids"), max_len)

    def decode(self, table: pa.Table) -> tuple:
        values, offsets = super().decode(table)
        labels = table.column(1).to_numpy().astype(np.int64) if self.label else None
        return values, offsets, labels

    def micro_batch(self, padded, real, lengths, held, groups, local) -> dict:
        out = {"input_ids": torch.from_numpy(padded), "attention_mask": torch.from_numpy(real.astype(np.int64)),
               "num_tokens": int(lengths.sum())}
        if self.label:
            labels = np.empty(len(local), dtype=np.int64)
            for g in np.unique(groups).tolist():
                here = groups == g
                labels[here] = held[g][2][local[here]]
            out["labels"] = torch.from_numpy(labels)
        return out


class PairsSource:
    """A user's map-style Dataset of ``(input, target)`` pairs: one group, held by the user's code."""

    chunk_samples = 128  # a few steps per fetch: each hand-over from a loader process costs the training process ~1 ms

    def __init__(self, inner: Dataset):
        self.inner = inner
        self.lengths = getattr(inner, "lengths", None)
        # A plain TensorDataset of (input, target) is fetched by indexing its tensors: ~0.1 ms a
        # micro-batch of 64 less than 64 item reads and a stack, the same tensors. Not a subclass that
        # reads items its own way, nor sparse tensors (no gather).
        kind = type(inner)
        self.by_index = (isinstance(inner, TensorDataset) and kind.__getitem__ is TensorDataset.__getitem__
                         and getattr(kind, "__getitems__", None) is None and len(inner.tensors) == 2
                         and all(t.layout == torch.strided for t in inner.tensors))
        self.group_sizes = np.array([len(inner)], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.inner)

    def groups_needed(self, ids: np.ndarray) -> list[int]:
        return []

    def fetch(self, ids: np.ndarray, sizes: Sequence[int], upcoming: Sequence[int], out=None) -> Iterable[dict]:
        """The fetch's items collated at once: as one ``Stacked`` pair of tensors when they collate
        to tensors (a loader process then hands over two arrays per fetch, not two shared-memory
        tensors per micro-batch, which cost the training process a millisecond or so each)."""
        if self.by_index:  # what item by item and default_collate give, in one gather per tensor
            index = torch.as_tensor(ids)
            x, y = (t[index].contiguous() for t in self.inner.tensors)
            return Stacked({"x": x, "y": y}, sizes)
        getitems = getattr(self.inner, "__getitems__", None)
        items = getitems(ids.tolist()) if getitems else [self.inner[i] for i in ids.tolist()]
        x, y = default_collate(items)
        if torch.is_tensor(x) and torch.is_tensor(y):
            return Stacked({"x": x, "y": y}, sizes)
        bounds = np.cumsum([0, *sizes]).tolist()
        pairs = [default_collate(items[a:b]) for a, b in zip(bounds, bounds[1:])]
        return [{"x": x, "y": y} for x, y in pairs]

    def slot_shapes(self) -> None:
        return None

    def release(self) -> None:
        """Nothing to drop: the user's dataset lives in memory as it is."""
