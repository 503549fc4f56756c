"""`etrain doctor` as a user runs it, with a storage root it cannot write: no cluster needed
(the cluster's checks are stood in for; tests/integration/test_training.py runs them for real)."""

from __future__ import annotations

from cluster import doctor
from trainers.cli import main


def test_an_unwritable_storage_root_fails_the_doctor_and_says_how_to_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(doctor, "check_ray", lambda address: [doctor.Finding("ok", f"Ray cluster at {address}")])
    (tmp_path / "file").write_text("x")
    code = main(["doctor", "--address", "127.0.0.1:1", "--storage-root", str(tmp_path / "file" / "root")])
    out = capsys.readouterr().out
    assert code == 1, out
    assert f"[FAIL] storage root {tmp_path / 'file' / 'root'} is not writable" in out
    assert "fix: choose a writable directory or bucket" in out and "1 blocking problem(s)" in out
