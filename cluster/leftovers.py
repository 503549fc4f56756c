"""Processes that outlive the local Ray they belonged to: found by the files they hold, stopped by pid.

A Ray worker's stdout and stderr are files of its session's folder (``logs/worker-*.out|err``),
and the session folder is that Ray's alone. When the Ray this process
started is shut down, its workers exit as their raylet goes, except one that hangs: Ray 2.60's
core worker can deadlock in its own teardown (``pubsub::Publisher::~Publisher`` waiting on the
asio scheduler it is being destroyed by) and then stays forever, ~400 MB, its parent gone.
Nothing of Ray will ever stop it, and a laptop's `etrain run` would leave one behind now and
then. A process still writing its output into the stopped session's folder once a grace period
has passed is such a worker (a user's ``tail -f`` of a log reads it on another descriptor, and
is left alone).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def writing_into(folder: Path) -> list[int]:
    """The processes (this user may inspect) whose stdout or stderr is a file under ``folder``;
    never this process. A zombie holds nothing (its files are closed)."""
    folder = Path(os.path.realpath(folder))
    prefix = f"{folder}{os.sep}"
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        pid = int(proc.name)
        if pid == os.getpid():
            continue
        for fd in ("1", "2"):
            try:
                if os.readlink(proc / "fd" / fd).startswith(prefix):
                    found.append(pid)
                    break
            except OSError:  # gone meanwhile, another user's, or the descriptor is closed
                continue
    return found


def stop_leftovers(folder: Path, grace_s: float = 10.0, poll_s: float = 0.2) -> list[int]:
    """Wait up to ``grace_s`` for the processes writing their output under ``folder`` to exit by
    themselves (a worker exits a moment after its raylet), then SIGKILL those still there: a
    hung teardown does not run signal handlers, so a gentler signal would not be heard.
    Returns the pids killed (none, normally)."""
    deadline = time.monotonic() + grace_s
    while (left := writing_into(folder)) and time.monotonic() < deadline:
        time.sleep(poll_s)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s  # a SIGKILL lands when the process next runs
    while writing_into(folder) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return left
