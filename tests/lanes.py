"""Run the whole suite as two lanes at once: everything on this machine's network, and beside it
the rehearsed cloud followed by modules in namespaces of their own.

- **main**: the unit tier and every module but those below, one after another.
- **beside**: tests/e2e/test_rehearsal.py (~5 minutes, mostly waiting on its cloud: `ray up`,
  a spot notice's deadline, Ray noticing a cut node; its nodes live in network namespaces, as
  other Unix users, so it shares only the CPUs), then tests/integration/test_code_tenant.py in
  namespaces of its own (``unshare --net --pid --mount``): its attacker job joins every Ray it
  can see and reads every folder it may, and must find only its own test's. Its own loopback,
  process table and /tmp/ray hide the main lane's Rays from it. Then, in fresh namespaces of
  their own (with a Ray of their own), the modules of :data:`BESIDE_MODULES`: the suite is
  CPU-bound, and its waits (a node's death, a worker group's start) leave a core idle that
  the other lane fills. The namespaces' first process (:func:`init`) reaps orphans, as an init
  must; when it exits the kernel stops what is left.

The beside lane's output is kept in a file and printed when both are done. The exit status is
the first non-zero of the runs'.

    python tests/lanes.py [pytest args for the main lane and the namespaced runs...]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REHEARSAL = "tests/e2e/test_rehearsal.py"
CODE_TENANT = "tests/integration/test_code_tenant.py"
# Modules that need nothing of the main lane's, sized so that both lanes end together.
BESIDE_MODULES = ["tests/integration/test_console.py", "tests/integration/test_data_scale.py",
                  "tests/integration/test_loss_golden.py", "tests/integration/test_spot_fallback.py",
                  "tests/integration/test_sweep.py"]
LANE_RAY_DIR = "/tmp/ray"  # what Ray and `ray start` use when RAY_TMPDIR is unset
PYTEST = [sys.executable, "-m", "pytest"]


def wait(*procs: subprocess.Popen) -> list[int]:
    """Their exit codes; on Ctrl-C each gets pytest's own interrupt (its fixtures clean up) first."""
    try:
        return [proc.wait() for proc in procs]
    except KeyboardInterrupt:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for proc in procs:
            proc.wait()
        raise


def init(argv: list[str]) -> int:
    """Process 1 of the code tenant's namespaces: bring up loopback, give them their own
    /tmp/ray, run ``argv`` and reap every orphan until it ends (a process whose parent died is
    handed to process 1; unreaped, it stays a zombie that tests would count as running)."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    own = tempfile.mkdtemp(prefix="ray-lane-")  # not etrain-*: tests look there for staging copies
    os.makedirs(LANE_RAY_DIR, exist_ok=True)
    subprocess.run(["mount", "--bind", own, LANE_RAY_DIR], check=True)
    child = subprocess.Popen(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):  # process 1 ignores signals it has no handler for
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        if pid == child.pid:
            subprocess.run(["umount", "--lazy", LANE_RAY_DIR], check=False)
            subprocess.run(["rm", "-rf", own], check=False)
            return os.waitstatus_to_exitcode(status)


def isolated(*pytest_argv: str) -> int:
    """pytest in network, PID and mount namespaces of its own (see :func:`init`)."""
    (code,) = wait(subprocess.Popen(["unshare", "--net", "--pid", "--fork", "--mount-proc", "--propagation",
                                     "private", sys.executable, __file__, "--init", "--", *PYTEST, *pytest_argv],
                                    cwd=REPO, start_new_session=True))
    sys.stdout.flush()
    return code


def beside(argv: list[str]) -> int:
    """The rehearsal, then the code tenant in its namespaces, then the other modules in theirs;
    the first non-zero exit status. On Ctrl-C each pytest gets its interrupt and is waited for:
    the rehearsal's fixtures take its cloud down (a cloud left up stops the next rehearsal
    from starting)."""
    (rehearsal,) = wait(subprocess.Popen([*PYTEST, REHEARSAL, "-q", "-p", "no:cacheprovider", "--durations=5"],
                                         cwd=REPO, start_new_session=True))
    sys.stdout.flush()
    codes = [rehearsal, isolated(CODE_TENANT, *argv), isolated(*BESIDE_MODULES, *argv)]
    return next((code for code in codes if code), 0)


def main(argv: list[str]) -> int:
    started = time.monotonic()
    log = Path(tempfile.mkstemp(prefix="etrain-beside-lane-", suffix=".log")[1])
    with log.open("w") as out:
        side = subprocess.Popen([sys.executable, __file__, "--beside", "--", *argv], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    main_lane = subprocess.Popen([*PYTEST, "tests", "--ignore=tests/gpu", f"--ignore={REHEARSAL}",
                                  f"--ignore={CODE_TENANT}", *(f"--ignore={m}" for m in BESIDE_MODULES), *argv],
                                 cwd=REPO, start_new_session=True)
    main_code, side_code = wait(main_lane, side)
    print(f"\n---- {REHEARSAL}, then {CODE_TENANT} and then {', '.join(BESIDE_MODULES)} in namespaces of their "
          f"own (ran beside the tests above; its log: {log})")
    print(log.read_text()[-30000:])
    print(f"---- all done in {time.monotonic() - started:.0f} s: main exit {main_code}, beside exit {side_code}")
    return main_code or side_code


if __name__ == "__main__":
    if sys.argv[1:2] == ["--init"]:
        sys.exit(init(sys.argv[3:]))
    if sys.argv[1:2] == ["--beside"]:
        sys.exit(beside(sys.argv[3:]))
    sys.exit(main(sys.argv[1:]))
