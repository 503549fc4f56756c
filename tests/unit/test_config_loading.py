"""Loading a spec (trainers.config.loading): the guide's template loads; files, overrides and the
digest the service passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainers.config.errors import SpecError
from trainers.config.loading import load_spec

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "configs" / "deployment-guide.json"


def test_guide_template_loads_unchanged():
    spec = load_spec(GUIDE)
    assert spec.name == "deployment-guide"
    assert (spec.training.batch_size, spec.training.learning_rate, spec.training.epochs) == (256, 5e-5, 10)
    assert spec.training.optimizer == "AdamW"
    assert spec.distributed.backend == "nccl" and spec.distributed.master_port == 29500
    assert spec.checkpoint.interval == 1000
    assert spec.checkpoint.run_folder == "checkpoints"
    assert spec.checkpoint.file_name(1000) == "model_1000.pt"


def test_all_example_configs_load():
    from trainers.sweep.spec import load_sweep

    for path in sorted((REPO / "configs").glob("*")):
        load_sweep(path) if "sweep:" in path.read_text() else load_spec(path)


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "My Job.yaml"
    p.write_text("training:\n  batch_size: 32\n")
    spec = load_spec(p, ["training.max_steps=7", "distributed.num_workers={min: 1, max: 2}", "data.shuffle=false"])
    assert spec.name == "my-job"
    assert spec.training.max_steps == 7 and spec.data.shuffle is False
    assert (spec.distributed.min_workers, spec.distributed.max_workers) == (1, 2)


def test_bad_override_is_reported(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("{}")
    with pytest.raises(SpecError) as info:
        load_spec(p, ["training.max_steps"])
    assert "expected key.path=value" in info.value.problems[0]
    with pytest.raises(SpecError) as info:
        load_spec(p, ["training.max_stepz=3"])
    assert info.value.problems[0].startswith("training.max_stepz: unknown key")


def test_a_spec_changed_after_it_was_checked_is_not_run(tmp_path):
    """The service passes the digest of the spec it checked; the attempt reads the stored bytes, and
    bytes that differ (a tenant's keys write near them) are refused before they are parsed."""
    import hashlib
    import subprocess
    import sys

    from trainers.sweep.spec import load_sweep

    spec = tmp_path / "j-1.json"
    spec.write_text('{"name": "j-1", "training": {"max_steps": 3}}')
    digest = hashlib.sha256(spec.read_bytes()).hexdigest()
    assert load_spec(spec, sha256=digest).training.max_steps == 3
    spec.write_text('{"name": "j-1", "training": {"max_steps": 4}}')
    with pytest.raises(SpecError) as err:
        load_spec(spec, sha256=digest)
    assert err.value.problems == [f"{spec}: its SHA-256 is not {digest}, the digest of the spec that was checked: it "
                                  "was changed after it was checked, so it is not run; submit the spec again"]
    with pytest.raises(SpecError, match="it was changed after it was checked"):
        load_sweep(spec, sha256=digest)
    run = subprocess.run([sys.executable, "-m", "trainers.train", str(spec), "--spec-sha256", digest.upper()],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 2 and "it was changed after it was checked, so it is not run" in run.stderr, run.stderr
