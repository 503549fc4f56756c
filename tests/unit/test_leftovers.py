"""Workers that outlive their local Ray are found by where their output goes, and stopped by pid.

Real processes stand in for Ray's workers: one whose stdout is a log file of the "session"
and that neither exits nor hears SIGTERM (as a worker hung in Ray's teardown), one that exits
by itself within the grace period, and two that must be left alone: a reader of that log (a
user's ``tail -f``) and a process writing elsewhere.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from cluster.leftovers import stop_leftovers, writing_into

HANG = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"


def start(code: str, stdout) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=stdout, stderr=subprocess.STDOUT)


def wait_for_output(log: Path) -> None:
    deadline = time.monotonic() + 30
    while "up" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_hung_worker_is_killed_and_the_others_are_left_alone(tmp_path):
    session, elsewhere = tmp_path / "session_1", tmp_path / "other"
    (session / "logs").mkdir(parents=True)
    elsewhere.mkdir()
    log = session / "logs" / "worker-1.out"
    procs = []
    try:
        with open(log, "w") as out, open(elsewhere / "x.out", "w") as other:
            hung = start(HANG, out)
            quitting = start("import time; time.sleep(0.5)", out)
            bystander = start(HANG, other)
            reader = subprocess.Popen([sys.executable, "-c", f"import time; f = open({str(log)!r}); time.sleep(600)"],
                                      stdout=subprocess.DEVNULL)
        procs = [hung, quitting, bystander, reader]
        wait_for_output(log)
        assert sorted(writing_into(session)) == sorted([hung.pid, quitting.pid])
        killed = stop_leftovers(session, grace_s=2, poll_s=0.05)
        assert killed == [hung.pid], "only the process that did not exit within the grace period is killed"
        assert hung.wait(10) == -9
        assert quitting.wait(10) == 0
        assert bystander.poll() is None and reader.poll() is None, "a process writing elsewhere, or reading the log, stays"
        assert writing_into(session) == []
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_symlinked_session_folder_is_matched_through_its_link(tmp_path):
    """Ray names the newest session ``session_latest``, a link; the descriptors name the real folder."""
    real = tmp_path / "session_2"
    (real / "logs").mkdir(parents=True)
    (tmp_path / "session_latest").symlink_to(real)
    with open(real / "logs" / "w.err", "w") as out:
        proc = start(HANG, out)
    try:
        wait_for_output(real / "logs" / "w.err")
        assert writing_into(tmp_path / "session_latest") == [proc.pid]
        assert writing_into(tmp_path / "session_") == [], "a folder whose name only begins the session's is not it"
    finally:
        proc.kill()
        proc.wait()


def test_nothing_left_returns_at_once(tmp_path):
    started = time.monotonic()
    assert stop_leftovers(tmp_path, grace_s=30) == []
    assert time.monotonic() - started < 10
