"""A crash in the interpreter's teardown, after pytest has ended, keeps pytest's exit status
(tests/fixtures/exit_status.py): a full run once passed every test and still exited with SIGSEGV."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

# An object that crashes the process when the interpreter clears this module at teardown: after
# every atexit hook, where the suite's crash was.
CRASHING_MODULE = textwrap.dedent("""
    import os
    import signal


    class CrashesAtTeardown:
        def __del__(self, kill=os.kill, pid=os.getpid(), segv=signal.SIGSEGV):  # the module's names are gone by then
            kill(pid, segv)


    KEPT = CrashesAtTeardown()


    def test_it(): assert {outcome}
""")
CONFTEST = textwrap.dedent("""
    import exit_status


    def pytest_configure(config):
        exit_status.install()


    def pytest_sessionfinish(session, exitstatus):
        exit_status.remember(session)
""")


def run_pytest(folder: Path, outcome: str, with_plugin: bool) -> subprocess.CompletedProcess:
    (folder / "test_crash.py").write_text(CRASHING_MODULE.format(outcome=outcome))
    (folder / "conftest.py").write_text(CONFTEST if with_plugin else "")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:faulthandler",
                           str(folder)], cwd=folder, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(FIXTURES), "PATH": "/usr/bin:/bin"})


def test_the_crash_is_real_without_the_exit_hook(tmp_path):
    out = run_pytest(tmp_path, "True", with_plugin=False)
    assert "1 passed" in out.stdout and out.returncode == -11, (out.returncode, out.stdout, out.stderr)


@pytest.mark.parametrize("outcome, status", [("True", 0), ("False", 1)])
def test_a_crash_at_teardown_keeps_pytests_status(tmp_path, outcome, status):
    out = run_pytest(tmp_path, outcome, with_plugin=True)
    assert out.returncode == status, (out.returncode, out.stdout, out.stderr)
    assert ("1 passed" if status == 0 else "1 failed") in out.stdout, out.stdout
