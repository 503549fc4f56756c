"""Ray workers that outlive the local Ray they belonged to: found by their log files, stopped by pid.

Ray starts each worker with its stdout and stderr on files of its session folder
(``logs/worker-<id>-<job>-<pid>.out|err``), and the session folder is that Ray's alone. When
the Ray this process started is shut down, its workers exit as their raylet goes, except one
that hangs: Ray 2.60's core worker can deadlock in its own teardown
(``pubsub::Publisher::~Publisher`` waiting on the asio scheduler it is being destroyed by) and
then stays forever, ~400 MB, its parent gone. Nothing of Ray will ever stop it, and a laptop's
`etrain run` would leave one behind now and then. A process of this user still writing into a
worker log of the stopped session once a grace period has passed is such a worker. Anything
else is left alone: a user's ``tail -f`` of a log (it reads on another descriptor), a command
whose output the user sent into the session's folder (not a worker log), another user's process.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

WORKER_LOG = re.compile(r"worker-[^/]+\.(out|err)(?: \(deleted\))?")  # readlink marks a removed file


def _logs(folder: Path) -> str:
    """The session's log folder as the descriptors name it (``session_latest`` is a link)."""
    return f"{os.path.realpath(folder)}{os.sep}logs{os.sep}"


def writing_into(folder: Path) -> list[int]:
    """This user's processes whose stdout or stderr is a worker log of the Ray session ``folder``;
    never this process. A zombie holds nothing (its files are closed)."""
    logs = _logs(folder)
    me, uid = os.getpid(), os.getuid()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        pid = int(proc.name)
        try:
            if pid == me or proc.stat().st_uid != uid:
                continue
        except OSError:  # gone meanwhile
            continue
        if _writes_worker_log(proc, logs):
            found.append(pid)
    return found


def _writes_worker_log(proc: Path, logs: str) -> bool:
    for fd in ("1", "2"):
        try:
            target = os.readlink(proc / "fd" / fd)
        except OSError:  # gone meanwhile, or the descriptor is closed
            continue
        if target.startswith(logs) and WORKER_LOG.fullmatch(target[len(logs):]):
            return True
    return False


def _kill_if_still_writing(pid: int, logs: str) -> bool:
    """SIGKILL ``pid`` through a pidfd, checked again once pinned (a pid freed since the scan and
    given to a new process is not that process)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # gone since the scan
        return False
    try:
        if not _writes_worker_log(Path(f"/proc/{pid}"), logs):
            return False
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(pidfd)


def stop_leftovers(folder: Path, grace_s: float = 10.0, poll_s: float = 0.2) -> list[int]:
    """Wait up to ``grace_s`` for the workers still writing into ``folder``'s logs to exit by
    themselves (a worker exits a moment after its raylet), then SIGKILL those still there: a
    hung teardown does not run signal handlers, so a gentler signal would not be heard.
    Returns the pids killed (none, normally)."""
    deadline = time.monotonic() + grace_s
    while (left := writing_into(folder)) and time.monotonic() < deadline:
        time.sleep(poll_s)
    killed = [pid for pid in left if _kill_if_still_writing(pid, _logs(folder))]
    deadline = time.monotonic() + grace_s  # a SIGKILL lands when the process next runs
    while killed and writing_into(folder) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return killed
