"""Two or more commands run at once, taking turns on the machine: the benches' way to compare.

This machine's speed swings by up to 2x within minutes (other tenants of its host): run one
after the other, a pair's ratio ranged 0.57-1.83 in one hour, so a ratio of runs told more about
the host than about what was compared. In turns of a few seconds both meet the same host. Each
command runs for a slice while every process of the others (their whole trees: torchrun's
ranks; an etrain driver, its own local Ray, Ray's workers) is stopped (SIGSTOP); the turns go
round until one ends, and the rest then run alone. Only a window of steps that lies wholly
inside one turn counts, from a moment after the turn began (a resumed process refills its
caches, and its ranks meet again): :func:`windows_in_slices`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

Command = tuple[list[str], dict]  # (argv, environment)


def stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name (state, parent pid, ...); None once the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun's ranks; the etrain driver's Ray: its GCS, raylet,
    dashboard, and the workers and actors the raylet started)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := stat_fields(int(entry))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def signal_tree(pid: int, sig: int) -> None:
    for p in descendants(pid):
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie waiting to be reaped)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def kill_tree(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGKILL ``proc`` and every process below it, and return once they have all died: a kill is
    delivered when the process next runs, which on a busy machine is a moment later."""
    tree = descendants(proc.pid)
    signal_tree(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + timeout_s
    while any(running(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.01)


def alternate(procs: dict[str, subprocess.Popen], slice_s: float) -> dict[str, list[tuple[float, float]]]:
    """Run the process trees one at a time, ``slice_s`` each in turn, the others stopped (SIGSTOP),
    until one of them ends; then all run on. Returns each one's running slices (wall clock)."""
    slices: dict[str, list[tuple[float, float]]] = {name: [] for name in procs}
    try:
        while all(p.poll() is None for p in procs.values()):
            for name, proc in procs.items():
                for other, p in procs.items():
                    if other != name:
                        signal_tree(p.pid, signal.SIGSTOP)
                signal_tree(proc.pid, signal.SIGCONT)
                began = time.time()
                try:
                    proc.wait(slice_s)
                except subprocess.TimeoutExpired:
                    pass
                slices[name].append((began, time.time()))
                if proc.poll() is not None:
                    break
    finally:
        for p in procs.values():
            signal_tree(p.pid, signal.SIGCONT)
    return slices


def windows_in_slices(marks: list[float], slices: list[tuple[float, float]], settle_s: float) -> list[float]:
    """The durations of the windows between consecutive ``marks`` that lie wholly inside one running
    slice, starting at least ``settle_s`` after it began (a resumed process first refills its caches
    and catches up with its peers): a window cut by a stop is not one the process ran through."""
    kept = []
    for a, b in zip(marks, marks[1:]):
        if any(start + settle_s <= a and b <= end for start, end in slices):
            kept.append(b - a)
    return kept


def run_in_turns(commands: dict[str, Command], slice_s: float, logs: Path, cwd: Path,
                 alone_timeout_s: float = 900) -> tuple[dict[str, list[tuple[float, float]]], dict[str, float]]:
    """Start ``commands`` (each one's output in ``logs/<name>.out``), run them in turns until one
    ends, then the rest alone to their ends. Returns (each one's turns, each one's seconds alone).

    A command that fails ends it all at once with its output (the others are not run on for
    nothing); on a failure or Ctrl-C no tree is left running, or stopped."""
    procs: dict[str, subprocess.Popen] = {}
    alone: dict[str, float] = {}

    def failed(name: str) -> SystemExit:
        output = (logs / f"{name}.out").read_text()
        return SystemExit(f"{name} run failed (exit {procs[name].returncode}):\n{output[-3000:]}")

    try:
        for name, (cmd, env) in commands.items():
            with open(logs / f"{name}.out", "w") as out:
                procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
            signal_tree(procs[name].pid, signal.SIGSTOP)  # the first turn starts each in its order
        slices = alternate(procs, slice_s)
        for name, proc in procs.items():
            if proc.poll() not in (None, 0):
                raise failed(name)  # the others are stopped in `finally`
        for name, proc in procs.items():
            began = time.time()
            proc.wait(alone_timeout_s)
            alone[name] = time.time() - began
            if proc.returncode != 0:
                raise failed(name)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                kill_tree(proc)
    return slices, alone
