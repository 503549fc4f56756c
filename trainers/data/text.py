"""Text for a Hugging Face model (``model.hf``), tokenized once per data set and tokenizer.

The driver reads ``data.source`` (Parquet or JSON Lines files, local or s3://), tokenizes it
with the model's tokenizer and writes the ids as Parquet under the storage root, in a folder
named by a hash of everything that decides them: the tokenizer's files, each source file's
name, size and modification time, the columns, the task and ``model.max_seq_len``. A later job
with the same inputs finds the folder and tokenizes nothing; a changed tokenizer or file gets
a new folder. Workers stream the ids with the loader every data set uses (row groups, the
windowed shuffle, exact resume at any world size) through ``sources.TextSource``.

A causal LM's documents are packed: each followed by EOS, concatenated and cut into rows of
``max_seq_len`` tokens, so only the very last row can hold padding. Classification keeps one
row per text (truncated to ``max_seq_len``) with its label, so rows keep their lengths and
``data.dynamic_batching`` buckets them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.json as pajson
import pyarrow.parquet as pq

from trainers.data.parquet import filesystem_for, write_parquet

if TYPE_CHECKING:
    from cluster.storage import StorageRoot
    from trainers.config.job import JobSpec

log = logging.getLogger(__name__)

CACHE_VERSION = 1  # raise when the tokenized layout changes: every cache folder is then made anew
CACHE_DIR = "datasets/tokenized"
META_FILE = "meta.json"
BATCH_ROWS = 2048  # texts tokenized per call
TEXT_SUFFIXES = (".parquet", ".jsonl")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
HF_CACHE_ENV = "ETRAIN_HF_CACHE"


# ------------------------------------------------------------------ folders


def hf_cache_dir() -> Path:
    """Where s3:// model folders are copied to: $ETRAIN_HF_CACHE or ~/.cache/etrain/hf."""
    return Path(os.environ.get(HF_CACHE_ENV) or Path.home() / ".cache" / "etrain" / "hf")


def local_folder(uri: str, field: str, weights: bool = True, cache: Path | None = None) -> str:
    """A save_pretrained folder on this machine: a local one as is, an s3:// prefix copied once
    into the cache (a new copy when any file's size or time changes). ``weights=False`` leaves
    the weight files behind (the driver only needs the tokenizer). ``field`` names the spec field
    in errors."""
    if not uri.startswith("s3://"):
        path = Path(uri.removeprefix("file://")).expanduser().resolve()
        if not path.is_dir():
            raise FileNotFoundError(f"{field}: {uri!r}: no such folder here: give the folder that "
                                    "save_pretrained wrote (on every node), or an s3:// prefix")
        return str(path)
    fs, base = filesystem_for(uri.rstrip("/"))
    infos = [i for i in fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
             if i.type == pafs.FileType.File and (weights or not i.path.endswith(WEIGHT_SUFFIXES))]
    if not infos:
        raise FileNotFoundError(f"{field}: {uri!r}: no files under this prefix: upload the folder that "
                                "save_pretrained wrote")
    listing = sorted((posixpath.relpath(i.path, base), i.size, str(i.mtime)) for i in infos)
    key = hashlib.sha256(json.dumps([uri, listing]).encode()).hexdigest()[:24]
    dest = (cache or hf_cache_dir()) / key
    if (dest / ".complete").exists():
        return str(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{key}-"))
    for rel, _, _ in listing:
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        with fs.open_input_stream(posixpath.join(base, rel)) as src, open(staging / rel, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    (staging / ".complete").write_text("")
    try:
        staging.rename(dest)
    except OSError:  # another process copied it first: theirs is the same
        shutil.rmtree(staging, ignore_errors=True)
    log.info("copied %s (%d files) to %s", uri, len(listing), dest)
    return str(dest)


def folder_digest(folder: str) -> str:
    """A hash of a tokenizer folder's files (names and bytes), weights left out."""
    h = hashlib.sha256()
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and path.name != ".complete":
            h.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


# ------------------------------------------------------------------ the source


def source_files(uri: str) -> tuple[pafs.FileSystem, list[pafs.FileInfo]]:
    """The text files of ``data.source``: the file itself, or every .parquet/.jsonl file in the folder."""
    fs, path = filesystem_for(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"data.source: {uri!r}: no such file or folder: check the path")
    if info.type == pafs.FileType.File:
        return fs, [info]
    found = sorted((i for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
                    if i.type == pafs.FileType.File and i.path.endswith(TEXT_SUFFIXES)), key=lambda i: i.path)
    if not found:
        raise FileNotFoundError(f"data.source: {uri!r}: the folder holds no .parquet or .jsonl files: "
                                "put the text there or name another folder")
    return fs, found


def read_batches(fs: pafs.FileSystem, info: pafs.FileInfo, columns: dict[str, str], uri: str) -> Iterator[pa.Table]:
    """A text file's columns (``{field: column}``), a batch of rows at a time (JSON Lines: the file whole)."""
    if info.path.endswith(".jsonl"):
        with fs.open_input_stream(info.path) as f:
            table = pajson.read_json(f)
        names = table.column_names
        batches = [table.select(list(columns.values()))] if set(columns.values()) <= set(names) else []
    else:
        pf = pq.ParquetFile(fs.open_input_file(info.path))
        names = pf.schema_arrow.names
        batches = None
    for field, name in columns.items():
        if name not in names:
            raise ValueError(f"data.columns.{field}: {name!r} is not a column of {uri} (it has "
                             f"{', '.join(sorted(names))}): name the right one in data.columns.{field}")
    if batches is None:
        batches = (pa.Table.from_batches([b]) for b in pf.iter_batches(BATCH_ROWS, columns=list(columns.values())))
    for table in batches:
        for start in range(0, table.num_rows, BATCH_ROWS):
            yield table.slice(start, BATCH_ROWS)


# ------------------------------------------------------------------ tokenizing


def cache_key(tokenizer_digest: str, files: list[pafs.FileInfo], settings: dict) -> str:
    listing = [(i.path, i.size, str(i.mtime)) for i in files]
    blob = json.dumps({"version": CACHE_VERSION, "tokenizer": tokenizer_digest, "files": listing, **settings},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def list_array(rows: list[np.ndarray]) -> pa.Array:
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int32, count=len(rows))
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)
    values = np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


class Packer:
    """Documents (each followed by EOS) into rows of exactly ``length`` tokens; the rest waits for
    the next documents, and ``finish`` gives the last, shorter row."""

    def __init__(self, length: int, eos_id: int):
        self.length, self.eos_id = length, eos_id
        self.carry = np.zeros(0, dtype=np.int64)

    def add(self, docs: list[list[int]]) -> list[np.ndarray]:
        parts = [self.carry]
        for ids in docs:
            parts.append(np.asarray(ids, dtype=np.int64))
            if not ids or ids[-1] != self.eos_id:
                parts.append(np.array([self.eos_id], dtype=np.int64))
        flat = np.concatenate(parts)
        full = len(flat) // self.length * self.length
        self.carry = flat[full:]
        return list(flat[:full].reshape(-1, self.length))

    def finish(self) -> list[np.ndarray]:
        rows = [self.carry] if len(self.carry) > 1 else []  # one token predicts nothing
        self.carry = np.zeros(0, dtype=np.int64)
        return rows


def integer_labels(column: pa.ChunkedArray, name: str, uri: str) -> np.ndarray:
    if not pa.types.is_integer(column.type) or column.null_count:
        raise ValueError(f"data.columns.label: {name!r} in {uri} holds {column.type}"
                         f"{' with missing values' if column.null_count else ''}: classification needs a whole "
                         "number class id (0 .. num_labels-1) in every row: convert the labels")
    return column.to_numpy().astype(np.int64)


def load_tokenizer(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def tokenize(spec: JobSpec, tokenizer, fs: pafs.FileSystem, files: list[pafs.FileInfo]) -> Iterator[tuple[pa.Table, dict]]:
    """Per source file, its rows as a table (input_ids, and label for classification) and counts."""
    hf, c, max_len = spec.model.hf, spec.data.columns, spec.model.max_seq_len
    causal = hf.task == "causal_lm"
    columns = {"text": c.text} if causal else {"text": c.text, "label": c.label}
    packer = Packer(max_len, eos_id(tokenizer, hf.tokenizer or hf.path)) if causal else None
    for n, info in enumerate(files):
        uri = spec.data.source if len(files) == 1 else info.path
        rows: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        texts = 0
        for table in read_batches(fs, info, columns, uri):
            strings = table.column(0).to_pylist()
            keep = [i for i, t in enumerate(strings) if t]
            batch = [strings[i] for i in keep]
            texts += len(batch)
            if causal:
                rows += packer.add(tokenizer(batch)["input_ids"]) if batch else []
                continue
            ids = tokenizer(batch, truncation=True, max_length=max_len)["input_ids"] if batch else []
            y = integer_labels(table.column(1), c.label, uri)[keep]
            nonempty = [i for i, row in enumerate(ids) if len(row) > 0]
            rows += [np.asarray(ids[i]) for i in nonempty]
            labels.append(y[nonempty])
        if causal and n == len(files) - 1:
            rows += packer.finish()
        out = {"input_ids": list_array(rows)}
        if not causal:
            out["label"] = pa.array(np.concatenate(labels) if labels else np.zeros(0, np.int64))
        tokens = int(sum(len(r) for r in rows))
        yield pa.table(out), {"texts": texts, "rows": len(rows), "tokens": tokens}


def eos_id(tokenizer, where: str) -> int:
    found = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if found is None:
        raise ValueError(f"model.hf: {where!r}: its tokenizer has no eos_token (nor sep_token) to separate packed "
                         "documents: set eos_token in its tokenizer_config.json")
    return int(found)


def prepare_text(spec: JobSpec, root: StorageRoot) -> str:
    """Tokenize ``data.source`` for ``model.hf`` once (driver side); the folder URI of the ids."""
    hf = spec.model.hf
    field = "model.hf.tokenizer" if hf.tokenizer else "model.hf.path"
    folder = local_folder(hf.tokenizer or hf.path, field, weights=False)
    fs, files = source_files(spec.data.source)
    settings = {"task": hf.task, "max_seq_len": spec.model.max_seq_len,
                "columns": [spec.data.columns.text, spec.data.columns.label if hf.task != "causal_lm" else None]}
    rel = posixpath.join(CACHE_DIR, cache_key(folder_digest(folder), files, settings))
    if root.exists(rel, META_FILE):
        meta = root.read_json(rel, META_FILE)
        log.info("tokenized text found (%s rows, %s): %s", meta["rows"], layout(meta), root.uri_of(rel))
        return root.uri_of(rel) + "/"
    tokenizer = load_tokenizer(folder)
    totals = {"texts": 0, "rows": 0, "tokens": 0}
    for n, (table, counts) in enumerate(tokenize(spec, tokenizer, fs, files)):
        if table.num_rows:
            root.write_bytes(write_parquet(table), rel, f"part-{n:05d}.parquet")
        totals = {k: totals[k] + counts[k] for k in totals}
    if not totals["rows"]:
        raise ValueError(f"data.source: {spec.data.source!r}: no text in column {spec.data.columns.text!r}: "
                         "every row is empty; check data.columns.text")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
        eos_id(tokenizer, hf.path) if hf.task == "causal_lm" else 0)
    meta = {**totals, **settings, "version": CACHE_VERSION, "pad_id": int(pad), "source": spec.data.source,
            "tokenizer": hf.tokenizer or hf.path, "mean_length": totals["tokens"] / totals["rows"]}
    if hf.task == "causal_lm":  # packed rows: the share of their positions that hold padding
        meta["padding_fraction"] = 1 - totals["tokens"] / (totals["rows"] * spec.model.max_seq_len)
    root.write_json(meta, rel, META_FILE)  # last: its presence says the folder is complete
    log.info("tokenized %d texts from %s into %d rows of up to %d tokens (%d tokens, %s): %s", totals["texts"],
             spec.data.source, totals["rows"], spec.model.max_seq_len, totals["tokens"], layout(meta), root.uri_of(rel))
    return root.uri_of(rel) + "/"


def layout(meta: dict) -> str:
    """How the rows fill their positions, for the log: packed rows' padding, or texts' mean length."""
    if "padding_fraction" in meta:
        return f"packed, padding {100 * meta['padding_fraction']:.2f}%"
    return f"a row per text, mean length {meta['mean_length']:.1f}: dynamic_batching buckets them by length"


def read_meta(data_uri: str) -> dict:
    """What ``prepare_text`` recorded beside the ids (pad id, counts, padding fraction)."""
    fs, path = filesystem_for(data_uri.rstrip("/"))
    with fs.open_input_stream(posixpath.join(path, META_FILE)) as f:
        return json.loads(f.read())
