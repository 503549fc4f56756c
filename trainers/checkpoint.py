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
import os
import posixpath
import re
import time
from dataclasses import dataclass

import pyarrow.fs as pafs
import torch

MANIFEST = "manifest.json"
DIR_PATTERN = re.compile(r"^checkpoint_(\d+)$")
FORMAT_VERSION = 1


def dir_name(step: int) -> str:
    return f"checkpoint_{step:09d}"


def step_of(name: str) -> int | None:
    m = DIR_PATTERN.match(name)
    return int(m.group(1)) if m else None


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_local(directory: str, state: dict, file_name: str) -> None:
    """Write the state, then the manifest that vouches for it (last, so it means 'complete')."""
    torch.save(state, os.path.join(directory, file_name))
    files = {}
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if name != MANIFEST and os.path.isfile(full):
            files[name] = {"size": os.path.getsize(full), "sha256": _sha256(full)}
    manifest = {"format": FORMAT_VERSION, "step": state["step"], "state_file": file_name,
                "files": files, "created_at": time.time()}
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
    os.replace(tmp, os.path.join(directory, MANIFEST))


def verify(fs: pafs.FileSystem, path: str) -> tuple[dict | None, str | None]:
    """(manifest, None) when every file matches its manifest, else (None, why not)."""
    try:
        with fs.open_input_stream(posixpath.join(path, MANIFEST)) as f:
            manifest = json.loads(f.read())
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


def find_restore(fs: pafs.FileSystem, run_path: str) -> tuple[Candidate | None, list[Candidate]]:
    """Verify checkpoints newest first, stopping at the first good one."""
    try:
        infos = fs.get_file_info(pafs.FileSelector(run_path, recursive=False, allow_not_found=True))
    except FileNotFoundError:
        infos = []
    found = sorted(((step_of(posixpath.basename(i.path)), i.path) for i in infos
                    if i.type == pafs.FileType.Directory and step_of(posixpath.basename(i.path)) is not None),
                   reverse=True)
    checked = []
    for step, path in found:
        _, problem = verify(fs, path)
        checked.append(Candidate(step, path, problem))
        if problem is None:
            break
    return choose_restore(checked)


def load_state(fs: pafs.FileSystem, path: str, map_location: str | torch.device = "cpu") -> dict:
    with fs.open_input_stream(posixpath.join(path, MANIFEST)) as f:
        state_file = json.loads(f.read())["state_file"]
    with fs.open_input_file(posixpath.join(path, state_file)) as f:
        return torch.load(f, map_location=map_location, weights_only=True)
