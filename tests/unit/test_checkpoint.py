"""Checkpoint integrity: only verified checkpoints restore; the skipped ones are named."""

from __future__ import annotations

import json
import os

import pyarrow.fs as pafs
import pytest
import torch

from trainers import checkpoint as ckpt
from trainers.checkpoint import Candidate, choose_restore


def make(run: str, step: int) -> str:
    d = os.path.join(run, ckpt.dir_name(step))
    os.makedirs(d)
    ckpt.write_local(d, {"step": step, "w": torch.arange(1000.0) * step}, f"model_{step}.pt")
    return d


@pytest.mark.parametrize("candidates,chosen,skipped", [
    ([], None, []),
    ([Candidate(10, "a", None)], 10, []),
    ([Candidate(10, "a", None), Candidate(20, "b", "corrupt")], 10, [20]),
    ([Candidate(30, "c", "no manifest"), Candidate(20, "b", "corrupt"), Candidate(10, "a", None)], 10, [30, 20]),
    ([Candidate(30, "c", "x"), Candidate(20, "b", "y")], None, [30, 20]),
    ([Candidate(5, "a", None), Candidate(7, "b", None)], 7, []),
])
def test_choose_restore(candidates, chosen, skipped):
    c, s = choose_restore(candidates)
    assert (c.step if c else None) == chosen
    assert [x.step for x in s] == skipped


def test_roundtrip_and_newest_wins(tmp_path):
    run = str(tmp_path)
    make(run, 10)
    make(run, 20)
    chosen, skipped = ckpt.find_restore(pafs.LocalFileSystem(), run)
    assert chosen.step == 20 and skipped == []
    state = ckpt.load_state(pafs.LocalFileSystem(), chosen.path)
    assert state["step"] == 20 and torch.equal(state["w"], torch.arange(1000.0) * 20)


@pytest.mark.parametrize("damage,reason", [
    ("truncate", "truncated"),
    ("corrupt", "SHA-256"),
    ("no_manifest", "no manifest.json"),
    ("delete_state", "missing"),
    ("garbage_manifest", "unreadable manifest"),
])
def test_damaged_newest_is_skipped_with_reason(tmp_path, damage, reason):
    run = str(tmp_path)
    make(run, 10)
    bad = make(run, 20)
    state = os.path.join(bad, "model_20.pt")
    manifest = os.path.join(bad, ckpt.MANIFEST)
    if damage == "truncate":
        with open(state, "r+b") as f:
            f.truncate(100)
    elif damage == "corrupt":
        with open(state, "r+b") as f:
            f.seek(200)
            f.write(b"\x00\xff" * 8)
    elif damage == "no_manifest":
        os.remove(manifest)
    elif damage == "delete_state":
        os.remove(state)
    else:
        with open(manifest, "w") as f:
            f.write("{not json")
    chosen, skipped = ckpt.find_restore(pafs.LocalFileSystem(), run)
    assert chosen.step == 10
    assert [s.step for s in skipped] == [20] and reason in skipped[0].problem


def test_manifest_lists_sizes_and_hashes(tmp_path):
    d = make(str(tmp_path), 3)
    manifest = json.loads(open(os.path.join(d, ckpt.MANIFEST)).read())
    assert manifest["state_file"] == "model_3.pt"
    meta = manifest["files"]["model_3.pt"]
    assert meta["size"] == os.path.getsize(os.path.join(d, "model_3.pt")) and len(meta["sha256"]) == 64


def test_missing_run_folder_means_fresh_start(tmp_path):
    assert ckpt.find_restore(pafs.LocalFileSystem(), str(tmp_path / "nope")) == (None, [])


K = ckpt.Kept


@pytest.mark.parametrize("entries,keep,mode,deleted", [
    ([K(1, 0.9, True), K(2, 0.5, True), K(3, 0.7, True), K(4, 0.8, True)], 2, None, [1, 2]),
    ([K(1, 0.9, True), K(2, 0.5, True), K(3, 0.7, True), K(4, 0.8, True)], 2, "min", [1]),
    ([K(1, 0.9, True), K(2, 0.5, True), K(3, 0.7, True), K(4, 0.8, True)], 1, "max", [2, 3]),
    ([K(1, 0.9, True), K(2, None, False), K(3, 0.7, True)], 1, None, [1, 2]),  # a partial one goes too
    ([K(1, 0.9, True), K(2, 0.5, True), K(3, None, False)], 1, None, [1]),     # newer, maybe uploading: kept
    ([K(1, 0.9, True), K(2, 0.5, True)], None, "min", []),
    ([], 3, "min", []),
])
def test_retention_plan(entries, keep, mode, deleted):
    assert ckpt.retention_plan(entries, keep, mode) == deleted


def test_prune_keeps_newest_and_best(tmp_path):
    run = str(tmp_path)
    for step, loss in [(10, 0.3), (20, 0.1), (30, 0.4), (40, 0.5)]:
        d = os.path.join(run, ckpt.dir_name(step))
        os.makedirs(d)
        ckpt.write_local(d, {"step": step}, f"model_{step}.pt", {"loss": loss})
    os.makedirs(os.path.join(run, ckpt.dir_name(25)))  # a writer killed before its manifest
    assert ckpt.prune(pafs.LocalFileSystem(), run, 2, "loss", "min") == [10, 25]
    assert sorted(os.listdir(run)) == [ckpt.dir_name(s) for s in (20, 30, 40)]
