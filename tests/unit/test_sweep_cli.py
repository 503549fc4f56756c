"""The sweep's command line (trainers.sweep.cli): a bad sweep is refused before Ray starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sweep_files import write_sweep

REPO = Path(__file__).resolve().parents[2]


def test_cli_refuses_a_bad_sweep_before_ray(tmp_path):
    p = write_sweep(tmp_path, {"training.batch_size": {"choice": []}})
    proc = subprocess.run([sys.executable, "-m", "trainers.cli", "sweep", str(p)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert "invalid sweep" in proc.stderr and "sweep.space.training.batch_size.choice: []: empty" in proc.stderr
    assert not (tmp_path / "st").exists()  # nothing written


def test_python_m_trainers_sweep_is_the_same_command(tmp_path):
    """`python -m trainers.sweep` (the service's sweep driver) runs the package's __main__, which only
    calls the command line's main."""
    p = write_sweep(tmp_path, {"training.batch_size": {"choice": []}})
    proc = subprocess.run([sys.executable, "-m", "trainers.sweep", str(p)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert "invalid sweep" in proc.stderr and "sweep.space.training.batch_size.choice: []: empty" in proc.stderr
    assert not (tmp_path / "st").exists()


def test_main_module_defines_nothing_tune_could_pickle_by_value():
    """cloudpickle copies __main__'s functions by value, defaults and all (a default ``print`` broke
    once Ray had replaced it): __main__ only imports and calls."""
    import ast

    tree = ast.parse((REPO / "trainers" / "sweep" / "__main__.py").read_text())
    defined = [type(n).__name__ for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                          ast.ClassDef, ast.Lambda))]
    assert defined == []


@pytest.mark.parametrize("as_json", [False, True])
def test_the_sweeps_lines_show_on_stdout_or_beside_its_json_on_stderr(monkeypatch, capsys, as_json):
    """What a person watches: our lines while the sweep runs, on stdout, or on stderr under --json
    (stdout then holds the report alone), and none once the command is done."""
    import json
    import logging

    from trainers.sweep import cli

    def run_sweep(plan, resume=False):
        logging.getLogger("trainers.sweep.tune_run").info("sweep 's': 2 sample(s)")
        logging.getLogger("trainers.sweep.trials").warning("could not remove")
        return 0, {"best": None}

    monkeypatch.setattr(cli, "load_sweep", lambda *a: object())
    monkeypatch.setattr(cli, "run_sweep", run_sweep)
    monkeypatch.setattr(cli, "render_report", lambda report: "the report")
    assert cli.main(["s.yaml", *(["--json"] if as_json else [])]) == 0
    logging.getLogger("trainers.sweep.tune_run").warning("after the command")
    out, err = capsys.readouterr()
    lines = "[etrain] sweep 's': 2 sample(s)\n[etrain] note: could not remove\n"
    if as_json:
        assert (json.loads(out), err) == ({"best": None}, lines)
    else:
        assert (out, err) == (lines + "the report\n", "")
