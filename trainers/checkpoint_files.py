"""Checkpoints that do not depend on world size, and never restore a partial one.

A checkpoint is one folder ``checkpoint_<step>`` in the job's run folder holding the full
training state from rank 0 (model, optimizer, LR scheduler, grad scaler, step, data
cursor, seed) in one file named by ``checkpoint.path``, plus ``manifest.json`` written
last with each file's size and SHA-256. A folder whose manifest is missing or does not
match its files is skipped on restore, with the reason said.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
import re
import time
from dataclasses import dataclass

import pyarrow.fs as pafs

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
DIR_PATTERN = re.compile(r"^checkpoint_(\d+)$")
FORMAT_VERSION = 1


def dir_name(step: int) -> str:
    return f"checkpoint_{step:09d}"


def step_of(name: str) -> int | None:
    m = DIR_PATTERN.match(name)
    return int(m.group(1)) if m else None


class _Hashing:
    """A write-only stream that hashes and counts what passes through it to ``out``."""

    def __init__(self, out):
        self.out, self.hash, self.size = out, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.hash.update(data)
        self.size += len(data)
        return self.out.write(data)

    def flush(self) -> None:
        """torch.save flushes; the storage stream uploads when it is closed."""


def write(fs: pafs.FileSystem, path: str, state: dict, file_name: str, metrics: dict | None = None,
          fresh: bool = False) -> dict:
    """Write a checkpoint folder straight to its place in storage and return its manifest.

    The state streams to storage as torch serialises it, hashed on the way (no local copy, no
    second read); the manifest that vouches for it goes last, whole, so its presence means
    'complete'. On S3 that is two PUTs and no folder markers.
    ``fresh``: the caller knows the folder holds nothing (a listing did not have it), so there
    is no old manifest to delete first: on S3 that saves a request (a HEAD) a checkpoint.
    """
    import torch  # here, not at the top: drivers list and verify checkpoints without torch

    from cluster.storage import write_whole

    if isinstance(fs, pafs.LocalFileSystem):
        fs.create_dir(path, recursive=True)
    manifest_path = posixpath.join(path, MANIFEST)
    if not fresh:
        try:  # a folder written again: its old manifest must not vouch for the new file
            fs.delete_file(manifest_path)
        except FileNotFoundError:
            pass
    with fs.open_output_stream(posixpath.join(path, file_name)) as out:
        hashing = _Hashing(out)
        torch.save(state, hashing)
    manifest = {"format": FORMAT_VERSION, "step": state["step"], "state_file": file_name,
                "files": {file_name: {"size": hashing.size, "sha256": hashing.hash.hexdigest()}},
                "created_at": time.time(), "metrics": metrics or {}}
    write_whole(fs, manifest_path, json.dumps(manifest, indent=2).encode())
    return manifest


def verify(fs: pafs.FileSystem, path: str) -> tuple[dict | None, str | None]:
    """(manifest, None) when every file matches its manifest, else (None, why not)."""
    try:
        manifest = read_manifest(fs, path)
    except FileNotFoundError:
        return None, "no manifest.json (the checkpoint was never completed)"
    except (OSError, ValueError) as exc:
        return None, f"unreadable manifest.json ({exc})"
    for name, meta in manifest.get("files", {}).items():
        h = hashlib.sha256()
        size = 0
        try:
            with fs.open_input_stream(posixpath.join(path, name)) as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                    size += len(chunk)
        except FileNotFoundError:
            return None, f"{name} is missing"
        if size != meta["size"]:
            return None, f"{name} has {size} bytes, manifest says {meta['size']} (truncated)"
        if h.hexdigest() != meta["sha256"]:
            return None, f"{name} does not match its SHA-256 (corrupt)"
    return manifest, None


@dataclass(frozen=True)
class Candidate:
    step: int
    path: str
    problem: str | None  # None when verified


def choose_restore(candidates: list[Candidate]) -> tuple[Candidate | None, list[Candidate]]:
    """Pick the newest verified checkpoint; return it with the newer ones skipped on the way.

    Pure, so tests can table-drive it: the caller verifies, this decides.
    """
    skipped = []
    for c in sorted(candidates, key=lambda c: c.step, reverse=True):
        if c.problem is None:
            return c, skipped
        skipped.append(c)
    return None, skipped


def checkpoint_folders(fs: pafs.FileSystem, run_path: str) -> list[tuple[int, str]]:
    """Every checkpoint folder in the run folder, newest first, as (step, path): one listing."""
    try:
        infos = fs.get_file_info(pafs.FileSelector(run_path, recursive=False, allow_not_found=True))
    except FileNotFoundError:
        infos = []
    return sorted(((step_of(posixpath.basename(i.path)), i.path) for i in infos
                   if i.type == pafs.FileType.Directory and step_of(posixpath.basename(i.path)) is not None),
                  reverse=True)


def find_restore(fs: pafs.FileSystem, run_path: str,
                 folders: list[tuple[int, str]] | None = None) -> tuple[Candidate | None, list[Candidate]]:
    """Verify checkpoints newest first, stopping at the first good one. ``folders``: the run
    folder's :func:`checkpoint_folders`, when the caller has listed it already."""
    checked = []
    for step, path in checkpoint_folders(fs, run_path) if folders is None else folders:
        _, problem = verify(fs, path)
        checked.append(Candidate(step, path, problem))
        if problem is None:
            break
    return choose_restore(checked)


def list_checkpoints(fs: pafs.FileSystem, run_path: str) -> list[dict]:
    """Every checkpoint folder, oldest first: step, path, whether its manifest exists, its metrics and size.

    Reads manifests only (no hashing), so listing is cheap; restore still verifies in full.
    """
    try:
        infos = fs.get_file_info(pafs.FileSelector(run_path, recursive=False, allow_not_found=True))
    except FileNotFoundError:
        return []
    out = []
    for info in infos:
        step = step_of(posixpath.basename(info.path))
        if info.type != pafs.FileType.Directory or step is None:
            continue
        try:
            manifest = read_manifest(fs, info.path)
        except (OSError, ValueError):
            manifest = None
        files = (manifest or {}).get("files", {}).values()
        metrics = (manifest or {}).get("metrics", {})
        out.append({"step": step, "path": info.path, "complete": manifest is not None,
                    "metrics": metrics if isinstance(metrics, dict) else {},
                    "size_bytes": sum(m["size"] for m in files if isinstance(m, dict) and type(m.get("size")) is int)})
    return sorted(out, key=lambda c: c["step"])


def read_manifest(fs: pafs.FileSystem, path: str) -> dict:
    """A checkpoint folder's manifest, unverified (:func:`verify` hashes every file). The files it
    names are plain names in the folder (ValueError otherwise): storage is writable by more than
    our jobs, and a name like '/x' or '../x' would read outside the checkpoint."""
    with fs.open_input_stream(posixpath.join(path, MANIFEST)) as f:
        manifest = json.loads(f.read())
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files", {}), dict):
        raise ValueError("the manifest is not a mapping of a state file and its files")
    names = [manifest.get("state_file"), *manifest.get("files", {})]
    if not all(isinstance(n, str) and n not in ("", ".", "..") and posixpath.basename(n) == n for n in names):
        raise ValueError("the manifest names a file outside its checkpoint's folder")
    return manifest


def load_state(fs: pafs.FileSystem, path: str, map_location: str = "cpu") -> dict:
    import torch

    state_file = read_manifest(fs, path)["state_file"]
    with fs.open_input_file(posixpath.join(path, state_file)) as f:
        return torch.load(f, map_location=map_location, weights_only=True)


@dataclass(frozen=True)
class Kept:
    step: int
    metric: float | None  # None: no manifest yet (in flight) or no such metric
    complete: bool


def retention_plan(entries: list[Kept], keep_newest: int | None, best_mode: str | None) -> list[int]:
    """Steps to delete: keep the ``keep_newest`` newest complete checkpoints, the best one by
    the metric, and anything newer than the newest complete one (it may be uploading now)."""
    complete = sorted((e for e in entries if e.complete), key=lambda e: e.step)
    if not complete or keep_newest is None:
        return []
    keep = {e.step for e in complete[-keep_newest:]}
    scored = [e for e in complete if e.metric is not None]
    if best_mode and scored:
        pick = min if best_mode == "min" else max
        keep.add(pick(scored, key=lambda e: e.metric).step)
    newest = complete[-1].step
    return sorted(e.step for e in entries if e.step not in keep and e.step <= newest)


class RetentionReadError(Exception):
    """Storage did not answer a read (throttled, timed out): nothing may be concluded from it."""


def retention_entry(fs: pafs.FileSystem, path: str, step: int, metric: str | None, sizes: dict[str, int]) -> Kept:
    """What retention may know of one checkpoint folder, or RetentionReadError. ``sizes``: its
    files' sizes by name, from the round's listing.

    Complete means a manifest and every file it lists at its size: a folder copied file by file
    (by an older version of this code through Ray's upload, or by hand) can show its manifest
    before the state file it vouches for. Only a missing (or
    garbled) manifest means incomplete; any other error says nothing about the checkpoint.
    """
    if MANIFEST not in sizes:
        return Kept(step, None, False)
    try:
        manifest = read_manifest(fs, path)
    except (FileNotFoundError, ValueError):  # gone since the listing, or a garbled manifest
        return Kept(step, None, False)
    except OSError as exc:
        raise RetentionReadError(f"{path}: {exc}") from exc
    if any(sizes.get(name) != meta["size"] for name, meta in manifest.get("files", {}).items()):
        return Kept(step, None, False)
    return kept(manifest, metric, step)


def kept(manifest: dict, metric: str | None, step: int) -> Kept:
    """What retention knows of the complete checkpoint of folder step ``step`` from its manifest."""
    value = manifest.get("metrics", {}).get(metric) if metric else None
    return Kept(step, float(value) if value is not None else None, True)


def prune(fs: pafs.FileSystem, run_path: str, keep_newest: int | None, metric: str | None,
          best_mode: str, known: dict[str, Kept] | None = None) -> list[int]:
    """Apply :func:`retention_plan` to the run folder; return the steps deleted.

    One recursive listing a round (on S3 one request) gives every folder and its files' sizes;
    the doomed folders go in one delete (:func:`cluster.storage.delete_trees`).
    A read that fails for any reason but absence (S3's 503 SlowDown, a timeout) skips this
    round: deleting on a guess could remove the best checkpoint. A delete that fails is said and
    tried again next round: retention is housekeeping, and training goes on.
    ``known``: complete checkpoints read in earlier rounds, by path (a complete checkpoint does
    not change), so a round reads the manifests of new ones only.
    """
    from cluster.storage import delete_trees

    known = {} if known is None else known
    try:
        listed = fs.get_file_info(pafs.FileSelector(run_path, recursive=True, allow_not_found=True))
        paths = {step: info.path for info in listed
                 if info.type == pafs.FileType.Directory and posixpath.dirname(info.path) == run_path.rstrip("/")
                 and (step := step_of(posixpath.basename(info.path))) is not None}
        sizes: dict[str, dict[str, int]] = {path: {} for path in paths.values()}
        for info in listed:
            if info.type == pafs.FileType.File and posixpath.dirname(info.path) in sizes:
                sizes[posixpath.dirname(info.path)][posixpath.basename(info.path)] = info.size
        entries = []
        for step, path in paths.items():
            entry = known.get(path) or retention_entry(fs, path, step, metric, sizes[path])
            if entry.complete:
                known[path] = entry
            entries.append(entry)
    except (RetentionReadError, OSError) as exc:
        log.warning(f"retention skipped this round (nothing deleted): could not read {exc}")
        return []
    doomed = retention_plan(entries, keep_newest, best_mode if metric else None)
    if not doomed:
        return []
    for step in doomed:
        known.pop(paths[step], None)  # read again if a failed delete leaves it
    try:
        delete_trees(fs, [paths[step] for step in doomed], listed)
    except OSError as exc:
        log.warning(f"retention could not delete {', '.join(dir_name(s) for s in doomed)} ({exc}); "
                    "the next round tries again")
        return []
    return doomed
