"""The sweep's command line (trainers.sweep.cli): a bad sweep is refused before Ray starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def test_the_sweeps_log_lines_show_on_the_commands_stream_while_it_runs():
    import io
    import logging

    from trainers.sweep.cli import sweep_log_shown

    shown = io.StringIO()
    with sweep_log_shown(shown):
        logging.getLogger("trainers.sweep.tune_run").info("[etrain] sweep 's': 2 sample(s)")
        logging.getLogger("trainers.sweep.trials").warning("[etrain] note: could not remove")
    logging.getLogger("trainers.sweep.tune_run").warning("after the command")
    assert shown.getvalue() == "[etrain] sweep 's': 2 sample(s)\n[etrain] note: could not remove\n"
    assert logging.getLogger("trainers.sweep").handlers == []
