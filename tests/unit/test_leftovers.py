"""Workers that outlive their local Ray are found by the worker logs they write, and stopped by pid.

Real processes stand in for Ray's workers: one whose output is a worker log of the "session"
and that neither exits nor hears SIGTERM (as a worker hung in Ray's teardown), one that exits
by itself within the grace period, and those that must be left alone: a reader of that log (a
user's ``tail -f``), a command whose output the user sent into the session's folder, and a
process writing elsewhere.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from cluster.leftovers import stop_leftovers, writing_into
from cluster.ray_adapter.local import shutdown_local_ray

HANG = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
# Up, then exits once its stdin closes: it ends within the grace period whenever the test says so.
QUIT_ON_EOF = "import sys; print('up', flush=True); sys.stdin.read()"


def start(code: str, stdout, stderr=subprocess.STDOUT, stdin=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=stdout, stderr=stderr, stdin=stdin)


def wait_for_output(log: Path, times: int = 1) -> None:
    deadline = time.monotonic() + 30
    while log.read_text().count("up") < times and time.monotonic() < deadline:
        time.sleep(0.05)


def session(tmp_path: Path, name: str = "session_1") -> Path:
    folder = tmp_path / name
    (folder / "logs").mkdir(parents=True)
    return folder


def test_a_hung_worker_is_killed_and_the_others_are_left_alone(tmp_path):
    folder, elsewhere = session(tmp_path), tmp_path / "other"
    elsewhere.mkdir()
    log = folder / "logs" / "worker-01ab-02000000-77.out"
    procs = []
    try:
        with open(log, "w") as out, open(folder / "logs" / "mine.log", "w") as users, \
                open(elsewhere / "x.out", "w") as other:
            hung = start(HANG, out)
            quitting = start(QUIT_ON_EOF, out, stdin=subprocess.PIPE)
            users_own = start(HANG, users)  # e.g. `etrain run ... > /tmp/ray/session_latest/logs/mine.log`
            bystander = start(HANG, other)
            reader = subprocess.Popen([sys.executable, "-c", f"import time; f = open({str(log)!r}); time.sleep(600)"],
                                      stdout=subprocess.DEVNULL)
        procs = [hung, quitting, users_own, bystander, reader]
        wait_for_output(log, times=2)
        assert sorted(writing_into(folder)) == sorted([hung.pid, quitting.pid])
        quitting.stdin.close()  # it exits during the grace period: never killed
        killed = stop_leftovers(folder, grace_s=2, poll_s=0.05)
        assert killed == [hung.pid], "only the worker that did not exit within the grace period is killed"
        assert hung.wait(10) == -9
        assert quitting.wait(10) == 0
        assert all(p.poll() is None for p in (users_own, bystander, reader)), \
            "a non-worker file in the session, a process writing elsewhere, a reader of the log: all stay"
        assert writing_into(folder) == []
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_stderr_alone_counts_and_the_caller_never_lists_itself(tmp_path):
    folder = session(tmp_path)
    err = folder / "logs" / "worker-9f-01000000-5.err"
    probe = ("import sys; from pathlib import Path; from cluster.leftovers import writing_into; "
             f"print(writing_into(Path({str(folder)!r})), flush=True)")
    with open(err, "w") as e:
        worker = start(HANG, subprocess.DEVNULL, stderr=e)  # its stdout is elsewhere
        try:
            deadline = time.monotonic() + 30
            while worker.pid not in writing_into(folder) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert writing_into(folder) == [worker.pid]
            # a process whose own output is a worker log of the folder does not list itself
            seen = subprocess.run([sys.executable, "-c", probe], stdout=subprocess.PIPE, stderr=e, text=True,
                                  timeout=60, cwd=Path(__file__).resolve().parents[2]).stdout.strip()
            assert seen == f"[{worker.pid}]"
        finally:
            worker.kill()
            worker.wait()


def test_a_symlinked_session_folder_is_matched_through_its_link(tmp_path):
    """Ray names the newest session ``session_latest``, a link; the descriptors name the real folder."""
    real = session(tmp_path, "session_2")
    (tmp_path / "session_latest").symlink_to(real)
    log = real / "logs" / "worker-1-01000000-9.out"
    with open(log, "w") as out:
        proc = start(HANG, out)
    try:
        wait_for_output(log)
        assert writing_into(tmp_path / "session_latest") == [proc.pid]
        assert writing_into(tmp_path / "session_") == [], "a folder whose name only begins the session's is not it"
    finally:
        proc.kill()
        proc.wait()


def test_nothing_left_returns_at_once(tmp_path, monkeypatch):
    """With no worker left there is no grace period to wait out: not one sleep."""
    import cluster.leftovers

    slept = []
    monkeypatch.setattr(cluster.leftovers.time, "sleep", slept.append)
    assert stop_leftovers(session(tmp_path), grace_s=30) == []
    assert slept == []


def test_only_a_ray_this_process_started_is_cleaned_up_after(tmp_path, monkeypatch):
    """Joined, ``ray.shutdown()`` stops nothing of that Ray: its workers are running and are left be."""
    import ray
    from ray._private import worker as ray_worker

    folder = session(tmp_path)
    log = folder / "logs" / "worker-2-01000000-3.out"
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    with open(log, "w") as out:
        proc = start(HANG, out)
    try:
        wait_for_output(log)
        node = SimpleNamespace(head=False, get_session_dir_path=lambda: str(folder))
        monkeypatch.setattr(ray_worker, "_global_node", node)
        assert shutdown_local_ray(grace_s=0.5) == []
        assert proc.poll() is None, "a worker of a joined Ray is not touched"
        node.head = True  # started here: a local start's driver is its head node
        assert shutdown_local_ray(grace_s=0.5) == [proc.pid]
        assert proc.wait(10) == -9
    finally:
        proc.kill()
        proc.wait()
