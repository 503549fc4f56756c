"""The checkpoint thread (trainers/checkpoint_thread.py): short GIL slices, SCHED_IDLE only where
the way back is allowed, a daemon that lets go of each snapshot and never holds up a worker's exit."""

from __future__ import annotations

import pytest


def test_short_gil_slices_only_while_the_background_work_runs():
    import sys

    from trainers.checkpoint_thread import short_gil_slices

    before = sys.getswitchinterval()
    with short_gil_slices(0.0005):
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    assert sys.getswitchinterval() == before
    with pytest.raises(RuntimeError), short_gil_slices(0.0005):
        raise RuntimeError("a failed upload")
    assert sys.getswitchinterval() == before


LINUX_ONLY = pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_IDLE"), reason="scheduling policies are Linux's")


@LINUX_ONLY
def test_where_a_thread_could_not_leave_sched_idle_the_checkpoint_thread_never_enters_it(monkeypatch):
    """Unprivileged with the usual RLIMIT_NICE of 0 (or root in a container without CAP_SYS_NICE),
    Linux refuses the way back from SCHED_IDLE: the probe says so, and the thread never yields."""
    import os

    from trainers import checkpoint_thread

    real = os.sched_setscheduler

    def no_way_back(pid, policy, param):
        if policy != os.SCHED_IDLE:
            raise PermissionError(1, "Operation not permitted")
        return real(pid, policy, param)

    monkeypatch.setattr(os, "sched_setscheduler", no_way_back)
    assert checkpoint_thread.idle_is_reversible.__wrapped__() is False
    monkeypatch.setattr(os, "sched_setscheduler", real)
    monkeypatch.setattr(checkpoint_thread, "idle_is_reversible", lambda: False)
    yielding = checkpoint_thread.Yielding(os.getpid(), True)
    seen = []
    for _ in range(3):
        yielding.before_work()
        with yielding.idle():
            seen.append(os.sched_getscheduler(0))
    assert seen == [os.sched_getscheduler(0)] * 3


@LINUX_ONLY
def test_a_refused_policy_change_turns_yielding_off_and_training_goes_on(monkeypatch, caplog):
    import os

    from trainers import checkpoint_thread

    monkeypatch.setattr(checkpoint_thread, "idle_is_reversible", lambda: True)
    yielding = checkpoint_thread.Yielding(os.getpid(), True)  # a thread that exists, then a sandbox that says no
    monkeypatch.setattr(os, "sched_setscheduler", lambda *a: (_ for _ in ()).throw(PermissionError(1, "seccomp")))
    with caplog.at_level("DEBUG"):
        for _ in range(2):
            yielding.before_work()
            with yielding.idle():
                pass
        yielding.hurry()
    assert yielding.enabled is False
    assert "checkpoint thread keeps its scheduling: [Errno 1] seccomp" in caplog.text


def test_a_worker_that_exits_with_a_checkpoint_in_flight_does_not_wait_for_it():
    """Ray shuts a worker down gracefully (a finished trial, a driver that is gone) while its
    training thread still runs: Python's exit must not join a checkpoint thread stuck in a report
    whose barrier no other rank will join (concurrent.futures' threads are joined at exit)."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent("""
        import threading, torch
        from trainers.checkpoint_writer import Checkpointer
        from trainers.config.loading import validate
        c = Checkpointer(validate({"name": "exit", "checkpoint": {"interval": 5}}), None, "run", 0, 1,
                         torch.device("cpu"), lambda step, jit: None)
        c._pending = c._thread.submit(threading.Event().wait)  # never returns
        print("exiting", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert "exiting" in done.stdout


def test_the_checkpoint_thread_lets_go_of_a_snapshot_once_it_is_written():
    """Not when the next one is handed over: rank 0 would hold two copies of its state at once."""
    import time
    import weakref

    from trainers.checkpoint_thread import BackgroundThread

    class Snapshot:
        pass

    thread = BackgroundThread("etrain-test")
    snapshot = Snapshot()
    gone = weakref.ref(snapshot)
    thread.submit(lambda s: None, snapshot).result(timeout=30)
    del snapshot
    deadline = time.monotonic() + 30
    while gone() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    thread.close()
    assert gone() is None
