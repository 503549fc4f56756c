"""tests/system_packages.sh, which `make test` runs before the suite: on a machine that lacks what the
tests need, it installs it when it can and otherwise names every missing package and the command,
and the suite does not start. Each case runs the real script (through the real Makefile where the
suite's start is the question) with a PATH that hides the tools, and a recording stand-in for
apt-get where one is wanted: nothing is installed by these tests."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "system_packages.sh"
NOBODY = 65534

# With none of their commands on PATH these are always missing; the other two are probed by path.
ALWAYS_MISSING = ["iproute2", "util-linux", "rsync", "prometheus", "chromium"]


def expected_missing() -> list[str]:
    """Every package the script should name under a PATH holding none of the tools, in its order."""
    venv_ok = Path("/usr/bin/python3").exists() and subprocess.run(
        ["/usr/bin/python3", "-c", "import ensurepip, venv"], capture_output=True).returncode == 0
    return (["iproute2", "util-linux"] + ([] if venv_ok else ["python3-venv"])
            + ([] if Path("/usr/sbin/sshd").exists() else ["openssh-server"])
            + ["rsync", "prometheus", "chromium"])


@pytest.fixture
def box():
    """A copy of the Makefile and the script, and a bin folder with only bash and make, in a folder
    another Unix user can read (pytest's tmp_path is private to root)."""
    top = Path(tempfile.mkdtemp(prefix="etrain-syspkg-"))
    try:
        top.chmod(0o777)
        repo = top / "repo"
        (repo / "tests").mkdir(parents=True)
        shutil.copy(REPO / "Makefile", repo)
        shutil.copy(REPO / "pyproject.toml", repo)
        shutil.copy(SCRIPT, repo / "tests")
        bin_dir = top / "bin"
        bin_dir.mkdir()
        for tool in ("bash", "make"):
            (bin_dir / tool).symlink_to(shutil.which(tool))
        for d in (top, repo, repo / "tests", bin_dir):
            d.chmod(0o777)
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


def fake_apt_get(bin_dir: Path, calls: Path) -> None:
    """An apt-get that records how it was called and installs nothing."""
    tool = bin_dir / "apt-get"
    tool.write_text(f'#!/bin/bash\necho "$*" >> {calls}\n')
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def run(cmd: list[str], *, path: Path, cwd: Path, as_root: bool) -> subprocess.CompletedProcess:
    """Run as root (a user namespace's root where the suite is not run as root) or as nobody."""
    if as_root and os.geteuid() != 0:
        cmd = [shutil.which("unshare"), "--user", "--map-root-user", *cmd]
    if not as_root and os.geteuid() == 0:
        cmd = [shutil.which("setpriv"), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd]
    env = {"PATH": str(path), "HOME": str(cwd)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_without_a_package_manager_make_test_names_every_missing_package_and_does_not_start(box):
    repo = box / "repo"
    out = run(["make", "test"], path=box / "bin", cwd=repo, as_root=True)
    missing = expected_missing()
    assert out.returncode != 0
    assert f"missing: {' '.join(missing)}\n" in out.stderr, out.stderr
    assert "apt-get is not on this machine's PATH" in out.stderr
    assert f"apt-get install -y --no-install-recommends {' '.join(missing)}" in out.stderr
    assert "The suite was not started." in out.stderr
    assert not (repo / ".venv").exists(), "make went on to build the venv"
    assert "pytest" not in out.stdout + out.stderr


def test_not_root_without_sudo_names_the_packages_and_installs_nothing(box):
    calls = box / "apt-calls"
    fake_apt_get(box / "bin", calls)
    out = run(["make", "test"], path=box / "bin", cwd=box / "repo", as_root=False)
    missing = expected_missing()
    assert out.returncode != 0
    assert "this is not root and sudo cannot run without a password" in out.stderr, out.stderr
    assert f"sudo apt-get update && sudo apt-get install -y --no-install-recommends {' '.join(missing)}" \
        in out.stderr
    assert not calls.exists(), "apt-get was called by a user who cannot install"
    assert not (box / "repo" / ".venv").exists()


def test_as_root_it_installs_exactly_the_missing_packages(box):
    calls = box / "apt-calls"
    fake_apt_get(box / "bin", calls)
    out = run(["bash", str(box / "repo" / "tests" / "system_packages.sh")], path=box / "bin", cwd=box,
              as_root=True)
    missing = expected_missing()
    assert out.returncode == 0, out.stderr
    assert calls.read_text().splitlines() == [
        "update -qq", f"install -y -qq --no-install-recommends {' '.join(missing)}"]
    assert f"Installing the system packages the test suite needs: {' '.join(missing)}" in out.stdout


def test_nothing_missing_means_nothing_is_asked_of_apt_get(box):
    """Every probed command present (stand-ins on PATH): the script returns at once, quietly."""
    calls = box / "apt-calls"
    fake_apt_get(box / "bin", calls)
    for tool in ("ip", "unshare", "nsenter", "setpriv", "rsync", "prometheus", "chromium"):
        (box / "bin" / tool).symlink_to(shutil.which("true"))
    out = run(["bash", str(box / "repo" / "tests" / "system_packages.sh")], path=box / "bin", cwd=box,
              as_root=True)
    still = [p for p in expected_missing() if p not in ALWAYS_MISSING]
    if still:  # sshd or Debian's venv absent: those two are probed by path, and must be named
        assert out.returncode == 0 and still == calls.read_text().split()[-len(still):]
    else:
        assert out.returncode == 0 and out.stdout == out.stderr == ""
        assert not calls.exists()
