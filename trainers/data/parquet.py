"""Parquet data sets read one row group at a time, from a local path or s3:// (through pyarrow.fs).

Only the footers are read up front (row counts per row group). Row groups are then read on
demand, by a background thread, into a small cache that holds what the next steps need and
drops the rest, so a worker's memory follows the shuffle window, never the data set's size.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

ROW_GROUP_BYTES = 16 * 2**20  # in memory, per row group the built-in sets are written with
MIN_ROW_GROUP_ROWS = 1024


def filesystem_for(uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem of a local path, s3:// (with the AWS settings) or other URI, and the path in it."""
    if uri.startswith("s3://"):
        from cluster.storage import s3_filesystem

        return s3_filesystem(), uri.removeprefix("s3://")
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(uri)


def write_parquet(table: pa.Table, row_group_bytes: int = ROW_GROUP_BYTES) -> bytes:
    """A Parquet file with row groups of about ``row_group_bytes`` (decoded): small enough that a
    worker holds a few at a time, large enough that reading one is a few big requests."""
    per_row = max(1, table.nbytes // max(1, table.num_rows))
    rows = max(MIN_ROW_GROUP_ROWS, row_group_bytes // per_row)
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=rows)
    return buf.getvalue()


class ParquetFiles:
    """One data set: its files and row groups, read by row group. Picklable: each process opens
    its own filesystem and files (a filesystem is not carried across a fork)."""

    def __init__(self, uri: str):
        self.uri = uri
        fs, path = filesystem_for(uri)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"data.source {uri!r}: no such file or folder")
        if info.type == pafs.FileType.Directory:
            found = fs.get_file_info(pafs.FileSelector(path, recursive=True))
            self.paths = sorted(f.path for f in found if f.type == pafs.FileType.File and f.path.endswith(".parquet"))
            if not self.paths:
                raise FileNotFoundError(f"data.source {uri!r}: the folder holds no .parquet files")
        else:
            self.paths = [path]
        self.groups: list[tuple[int, int]] = []  # (file, row group in it)
        sizes: list[int] = []
        for f, p in enumerate(self.paths):
            meta = self._file(p, fs).metadata
            if f == 0:
                self.schema = self._file(p, fs).schema_arrow
            for g in range(meta.num_row_groups):
                self.groups.append((f, g))
                sizes.append(meta.row_group(g).num_rows)
        self.group_sizes = np.array(sizes, dtype=np.int64)
        first = self._file(self.paths[0], fs).metadata.row_group(0)
        self.row_bytes = first.total_byte_size / max(1, first.num_rows)  # decoded, from the footer
        self._opened: dict = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_opened": {}}

    def _file(self, path: str, fs: pafs.FileSystem | None = None) -> pq.ParquetFile:
        key = (os.getpid(), path)
        opened = self.__dict__.setdefault("_opened", {})
        if key not in opened:
            if fs is None:
                fs = opened.get((os.getpid(), "fs")) or filesystem_for(self.uri)[0]
                opened[(os.getpid(), "fs")] = fs
            opened[key] = pq.ParquetFile(fs.open_input_file(path))
        return opened[key]

    @property
    def column_names(self) -> list[str]:
        return self.schema.names

    def read(self, group: int, columns: list[str]) -> pa.Table:
        """One row group's columns. Arrow's allocator keeps freed pages for reuse, so a worker that
        reads row group after row group would grow by the reader's buffers and every dropped
        group; they go back to the system after each read, so memory follows what is held."""
        f, g = self.groups[group]
        table = self._file(self.paths[f]).read_row_group(g, columns=columns)
        pa.default_memory_pool().release_unused()
        return table

    def list_lengths(self, column: str) -> np.ndarray:
        """Every row's list length in ``column``, streamed one row group at a time."""
        return np.concatenate([pc.list_value_length(self.read(g, [column]).column(0)).to_numpy(zero_copy_only=False)
                               for g in range(len(self.groups))]).astype(np.int64)


class RowGroupCache:
    """Decoded row groups for the steps at hand and the next ones, read in the background.

    ``hold(needed, upcoming)`` returns the needed groups (waiting for them if they are still
    being read), starts reading the upcoming ones, and forgets every other group. The memory
    held is therefore what two consecutive fetches need, however large the data set.
    """

    def __init__(self, load: Callable[[int], Any]):
        self.load = load
        self.peak_groups = 0  # most groups held at once, for tests and logs
        self._pid = -1

    def __getstate__(self) -> dict:
        return {"load": self.load, "peak_groups": 0, "_pid": -1}

    def _ready(self) -> None:
        if self._pid != os.getpid():  # a fresh process (a loader worker): its own thread, nothing held
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="etrain-rowgroups")
            self._held: dict[int, Future] = {}
            self._lock = threading.Lock()
            self._pid = os.getpid()

    def hold(self, needed: Iterable[int], upcoming: Iterable[int]) -> dict[int, Any]:
        self._ready()
        needed, upcoming = list(needed), [g for g in upcoming if g not in set(needed)]
        keep = set(needed) | set(upcoming)
        with self._lock:
            for g in list(self._held):
                if g not in keep:
                    self._held.pop(g).cancel()
            for g in needed + upcoming:
                if g not in self._held:
                    self._held[g] = self._pool.submit(self.load, g)
            self.peak_groups = max(self.peak_groups, len(self._held))
            futures = {g: self._held[g] for g in needed}
        return {g: f.result() for g, f in futures.items()}

    def clear(self) -> None:
        """Drop everything held (the loader moves to worker processes, which hold their own)."""
        self._ready()
        with self._lock:
            for f in self._held.values():
                f.cancel()
            self._held.clear()
