"""A local Ray is sized by the CPUs this process may use, not by the machine's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_process_held_to_one_cpu_sizes_its_local_ray_by_that_cpu():
    """Under taskset (or a container's cpuset) os.cpu_count() still says the machine's count."""
    assert len(os.sched_getaffinity(0)) >= 2, "this test needs a machine with two CPUs to hold a process to one"
    cpu = min(os.sched_getaffinity(0))
    out = subprocess.run(["taskset", "--cpu-list", str(cpu), sys.executable, "-c",
                          "import os; from trainers.launch import usable_cpus; print(usable_cpus(), os.cpu_count())"],
                         capture_output=True, text=True, cwd=REPO, timeout=120, check=True)
    usable, machine = map(int, out.stdout.split())
    assert (usable, machine) == (1, os.cpu_count())
