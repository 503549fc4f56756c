"""Run the whole suite as three lanes at once, each with its own Rays, ports and processes.

The suite is mostly Ray start-up (CPU) and waiting on Ray (a node's death, a spot notice's
deadline, `ray up` over ssh); one lane leaves a quarter of this machine's two cores idle.

- **main**: the unit tier and the modules on the shared local Ray (training, the service,
  security, the job page, the loss goldens), on this machine's own network and processes.
- **beside**: every other module, in namespaces of its own (``unshare --net --pid --mount``):
  its own loopback, so its Rays, sshd, Prometheus and Serve take the ports they would take
  alone (Ray's node agent has a fixed port, 52365; the `ray up` twin needs 22 and 8265); its
  own process table, so Ray's "any GCS on this machine" lookups and the code tenant's attacker
  (which joins every Ray it can see) find only this lane's; and its own /tmp/ray, where Ray
  records the address `auto` means. Tests within a lane still run one after another, so the
  code tenant's test is alone in what it can see. The lane's first process (:func:`init`)
  reaps orphans, as an init must, and when it exits the kernel stops whatever is left in it.
- **rehearsal** (tests/e2e/test_rehearsal.py): its cloud's nodes live in network namespaces of
  their own, as other Unix users, so it shares only the CPUs; it runs beside from the start.

The beside and rehearsal lanes' output is kept in files and printed when all are done. The exit
status is the first non-zero of the lanes'.

    python tests/lanes.py [pytest args for every lane...]
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
# The modules that bring up Rays of their own, and enough of the shared-Ray ones to even out the
# CPU the two lanes take (measured: training ~580 CPU-s, service ~420, sweeps ~260).
BESIDE = ["tests/e2e/test_ray_up.py", "tests/e2e/test_chaos.py", "tests/integration/test_spot_fallback.py",
          "tests/integration/test_code_tenant.py", "tests/integration/test_elastic.py",
          "tests/integration/test_spot_elastic.py", "tests/integration/test_console.py",
          "tests/integration/test_data_scale.py", "tests/integration/test_observability.py",
          "tests/integration/test_sweep.py"]
LANE_RAY_DIR = "/tmp/ray"  # what Ray and `ray start` use when RAY_TMPDIR is unset


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
    """Process 1 of the beside lane's namespaces: bring up loopback, give the lane its own
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


def main(argv: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest"]
    started = time.monotonic()
    logs = {}
    procs = {}
    for lane, command in (
            ("rehearsal", [*pytest, REHEARSAL, "-q", "-p", "no:cacheprovider", "--durations=5"]),
            ("beside", ["unshare", "--net", "--pid", "--fork", "--mount-proc", "--propagation", "private",
                        sys.executable, __file__, "--init", "--", *pytest, *BESIDE, *argv])):
        logs[lane] = Path(tempfile.mkstemp(prefix=f"etrain-{lane}-lane-", suffix=".log")[1])
        with logs[lane].open("w") as out:
            procs[lane] = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True)
    ignored = [f"--ignore={m}" for m in (REHEARSAL, *BESIDE)]
    procs["main"] = subprocess.Popen([*pytest, "tests", "--ignore=tests/gpu", *ignored, *argv], cwd=REPO,
                                     start_new_session=True)
    codes = dict(zip(procs, wait(*procs.values())))
    for lane in ("beside", "rehearsal"):
        print(f"\n---- the {lane} lane (ran at the same time as the tests above; its log: {logs[lane]})")
        print(logs[lane].read_text()[-30000:])
    print(f"---- all done in {time.monotonic() - started:.0f} s: "
          + ", ".join(f"{lane} exit {code}" for lane, code in codes.items()))
    return next((code for code in codes.values() if code), 0)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--init"]:
        sys.exit(init(sys.argv[3:]))
    sys.exit(main(sys.argv[1:]))
