"""Issue 44 on a real Ray Tune: a sweep's state read back on resume is only what its driver wrote.

Tune unpickles ``tuner.pkl``, the experiment state and the searcher state when it restores a
sweep; the tenant can write that storage directly. Through the signed filesystem a planted
pickle is refused before it is loaded; through the plain one the same pickle runs (so it is the
wrapper that protects, not something else on the way).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import sys
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import ray.cloudpickle
from ray import tune

from cluster.signed_fs import TAG_SUFFIX, UnverifiedFileError, key_from_hex, new_key, signed_filesystem, verify_folder

pytestmark = [pytest.mark.ray, pytest.mark.no_dashboard]
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers do not import tests/integration


def trainable(config):
    """A few reports; fails while ``config["fail_flag"]`` exists and ``config["i"]`` is 1 (the resume's work)."""
    for step in range(3):
        if config["i"] == 1 and step == 1 and os.path.exists(config["fail_flag"]):
            raise RuntimeError("planned failure: the resumed sweep reruns this trial")
        tune.report({"x": config["i"] * 10 + step})


class CreatesMarker:
    """What a tenant would plant: unpickling it runs ``open(marker, "w")``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def plant(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps(CreatesMarker(marker)))  # the tenant's own S3 keys write the prefix directly


@contextlib.contextmanager
def failed_resumes():
    """The errors Tune's controller logs when it gives up a resume (it then starts the sweep over)."""
    failures: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.exc_info and "restore the run state" in record.getMessage():
                failures.append(f"{record.exc_info[0].__name__}: {record.exc_info[1]}")

    handler = Keep(level=logging.ERROR)
    controller_log = logging.getLogger("ray.tune.execution.tune_controller")
    controller_log.addHandler(handler)
    try:
        yield failures
    finally:
        controller_log.removeHandler(handler)


def test_a_signed_sweep_resumes_and_a_planted_pickle_is_refused(ray_local, tmp_path):
    storage = tmp_path / "storage"
    storage.mkdir()
    key = key_from_hex(new_key())
    signed = signed_filesystem(pafs.LocalFileSystem(), str(storage), key)
    flag = tmp_path / "fail-once"
    flag.touch()

    grid = tune.Tuner(
        trainable, param_space={"i": tune.grid_search([0, 1]), "fail_flag": str(flag)},
        run_config=tune.RunConfig(name="tune", storage_path=str(storage), storage_filesystem=signed, verbose=0),
    ).fit()
    assert grid.num_errors == 1
    tune_dir = storage / "tune"
    written = [p for p in tune_dir.rglob("*") if p.is_file() and not p.name.endswith(TAG_SUFFIX)]
    assert {"tuner.pkl"} <= {p.name for p in written} and any(p.name.startswith("experiment_state") for p in written)
    unsigned = [p for p in written if not Path(str(p) + TAG_SUFFIX).exists()]
    assert not unsigned, f"Tune wrote these around the signed filesystem: {unsigned}"
    for p in [tune_dir / "tuner.pkl", *tune_dir.glob("experiment_state-*.json")]:  # Tune pickles the filesystem in
        assert key not in p.read_bytes() and key.hex().encode() not in p.read_bytes(), p

    # (a) An honest resume through the signed filesystem reruns the failed trial to its end.
    flag.unlink()
    restored = tune.Tuner.restore(str(tune_dir), trainable, resume_errored=True, storage_filesystem=signed)
    grid = restored.fit()
    assert grid.num_errors == 0
    assert sorted(r.metrics["x"] for r in grid) == [2, 12]

    # (b) tuner.pkl replaced by the tenant: refused before it is unpickled ...
    good_tuner = (tune_dir / "tuner.pkl").read_bytes()
    marker = tmp_path / "pwned-by-tuner-pkl"
    plant(tune_dir / "tuner.pkl", marker)
    with pytest.raises(UnverifiedFileError, match=r"tuner\.pkl: was not written by this sweep's driver"):
        tune.Tuner.restore(str(tune_dir), trainable, storage_filesystem=signed)
    assert not marker.exists()
    # ... while the plain filesystem runs the tenant's code.
    with pytest.raises(AttributeError):  # Tune then treats the file object it got as its state
        tune.Tuner.restore(str(tune_dir), trainable, storage_filesystem=pafs.LocalFileSystem())
    assert marker.exists(), "the planted tuner.pkl did not run through the plain filesystem: the test proves nothing"
    (tune_dir / "tuner.pkl").write_bytes(good_tuner)

    # (c) The searcher's state, which Tune copies to a local folder and unpickles from there. Tune's
    # controller catches a failed resume and starts the sweep over, so the refusal shows in its log
    # (and a driver checks first: verify_folder). The plain filesystem goes first, on a copy: the
    # sweep it starts over writes newer state, which Tune would pick over the planted one.
    snapshot = tmp_path / "snapshot"
    shutil.copytree(tune_dir, snapshot)
    states = sorted(p.name for p in tune_dir.glob("basic-variant-state-*.json"))
    assert states, sorted(p.name for p in tune_dir.iterdir())
    marker = tmp_path / "pwned-by-searcher-state"
    for name in states:
        plant(tune_dir / name, marker)
    tune.Tuner.restore(str(tune_dir), trainable, storage_filesystem=pafs.LocalFileSystem()).fit()
    assert marker.exists(), "the planted searcher state did not run through the plain filesystem"

    marker.unlink()
    shutil.rmtree(tune_dir)
    shutil.copytree(snapshot, tune_dir)
    for name in states:
        plant(tune_dir / name, marker)
    with pytest.raises(UnverifiedFileError, match=r"basic-variant-state-.*was not written by this sweep's driver"):
        verify_folder(signed, str(tune_dir))
    with failed_resumes() as failures:
        tune.Tuner.restore(str(tune_dir), trainable, storage_filesystem=signed).fit()
    assert any("basic-variant-state" in f and "was not written by this sweep's driver" in f for f in failures), failures
    assert not marker.exists()
