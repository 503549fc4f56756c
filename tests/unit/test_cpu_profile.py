"""The suite's CPU profile (tests/fixtures/cpu_profile.py) counts processes that are gone: a test
whose work runs in an orphaned grandchild that exits before the test ends (as Ray's workers do,
reaped by a raylet that keeps no account of them) is charged that work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

BURN = """
import subprocess, sys, time

def test_burns_in_an_orphan(tmp_path):
    done = tmp_path / "done"
    # sh starts python in the background and exits at once: python is orphaned, reparented away from us
    burn = ("import pathlib, sys, time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass\\n"
            "pathlib.Path(sys.argv[1]).touch()")
    subprocess.run(["sh", "-c", f"{sys.executable} -c \\"$0\\" \\"$1\\" &", burn, str(done)], check=True)
    deadline = time.monotonic() + 60
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done.exists()

def test_idle():
    time.sleep(0.5)
"""


def run_profiled(tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp_path / "test_burn.py").write_text(BURN)
    out = tmp_path / "profile.jsonl"
    env = {**os.environ, "ETRAIN_CPU_PROFILE": str(out), "PYTHONPATH": str(FIXTURES)}
    code = "import sys, pytest, cpu_profile\nclass P:\n    def pytest_configure(self, config): cpu_profile.install(config)\n" \
           "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', sys.argv[1]], plugins=[P()]))"
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "test_burn.py")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    return done, out


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups need root: CI runs as root")
def test_an_exited_orphans_cpu_is_charged_to_its_test(tmp_path):
    groups = set(Path("/sys/fs/cgroup/cpuacct").glob("etrain-profile-*"))
    done, out = run_profiled(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["test"].split("::")[1]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["test_burns_in_an_orphan"]["cpu_s"] >= 0.5, rows
    assert rows["test_idle"]["cpu_s"] < 0.3, rows
    assert set(Path("/sys/fs/cgroup/cpuacct").glob("etrain-profile-*")) <= groups, "the run's cgroup is removed"


def test_the_report_sums_modules_and_lists_the_costliest_tests(tmp_path):
    import cpu_profile

    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"test": "tests/a.py::t1", "cpu_s": 3.0, "wall_s": 2.0}, {"test": "tests/a.py::t2", "cpu_s": 1.0, "wall_s": 1.0},
        {"test": "tests/b.py::t3", "cpu_s": 5.0, "wall_s": 9.0}]))
    text = cpu_profile.report(str(path), top=2)
    assert text.splitlines()[0].startswith("9 CPU-s in 3 tests")
    modules = text.split("\n\n")[0]
    assert modules.index("tests/b.py") < modules.index("tests/a.py") and "    4.0     3.0  tests/a.py" in modules
    assert "tests/b.py::t3" in text and "tests/a.py::t1" in text and "tests/a.py::t2" not in text
