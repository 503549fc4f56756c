"""Run the whole suite as two lanes at once: the rehearsed cloud beside everything else.

The rehearsal (tests/e2e/test_rehearsal.py) spends most of its ~4 minutes waiting on its cloud:
`ray up`, a spot notice's deadline, Ray noticing a cut node. Its nodes live in network
namespaces, as other Unix users with their own homes and Ray temp dirs, so it shares nothing
with the other tests but the CPUs; it runs beside them instead of after them. Its output is
kept in a file and printed when both lanes are done.

The code tenant's test runs alone afterwards: its attacker job joins every Ray it sees on the
machine (it found the rehearsal's and failed there), and must find only its own test's.
The exit status is the first non-zero of the three runs'.

    python tests/lanes.py [pytest args for the main lane...]
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
BESIDE = "tests/e2e/test_rehearsal.py"
ALONE = "tests/integration/test_code_tenant.py"


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


def main(argv: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest"]
    log = Path(tempfile.mkstemp(prefix="etrain-rehearsal-lane-", suffix=".log")[1])
    started = time.monotonic()
    with log.open("w") as out:
        beside = subprocess.Popen([*pytest, BESIDE, "-q", "-p", "no:cacheprovider", "--durations=5"], cwd=REPO,
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    main_lane = subprocess.Popen([*pytest, "tests", "--ignore=tests/gpu", f"--ignore={BESIDE}", f"--ignore={ALONE}",
                                  *argv], cwd=REPO, start_new_session=True)
    main_code, beside_code = wait(main_lane, beside)
    print(f"\n---- {BESIDE} (ran beside the tests above; its log: {log})")
    print(log.read_text()[-20000:])
    print(f"---- {ALONE}, alone on the machine")
    (alone_code,) = wait(subprocess.Popen([*pytest, ALONE, *argv], cwd=REPO, start_new_session=True))
    print(f"---- all done in {time.monotonic() - started:.0f} s: main exit {main_code}, rehearsal exit {beside_code}, "
          f"code tenant exit {alone_code}")
    return main_code or beside_code or alone_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
