"""`etrain run` in a terminal (a real pseudo-terminal) and piped: one live progress line on the
TTY, plain lines without one, Ray's own chatter only with --verbose.

The terminal run and the piped run go side by side: each is mostly process and Ray Train
start-up, which leaves the cores idle at moments, and the shared Ray has room for both."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainers.console import Console, strip_ansi

pytestmark = [pytest.mark.ray, pytest.mark.no_dashboard]
REPO = Path(__file__).resolve().parents[2]
LIVE_LINE = re.compile(r"step (\d+)/30 \D{0,200}?\d+%\s+loss \d+\.\d{4}\s+\d+ samples/s\s+eta \d+:\d\d:\d\d")


def command(root: Path, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "service.cli", "run", "configs/quickstart.yaml", "--set", f"name={name}",
            "--set", "training.max_steps=30", "--set", "training.log_interval_steps=5", "--set", "checkpoint.interval=10",
            "--set", f"checkpoint.storage_root={root}", *extra]


def environment(ray_local) -> dict[str, str]:
    """The test's Ray (joined, not started: quicker), a terminal type, no colour overrides."""
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "TERM", "COLUMNS")}
    return {**env, "PYTHONPATH": str(REPO), "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address,
            "TERM": "xterm-256color"}


def run_in_terminal(cmd: list[str], env: dict[str, str], timeout_s: float = 300) -> tuple[int, str]:
    """Run ``cmd`` with a pseudo-terminal (100 x 30) as its stdin, stdout and stderr; return (rc, output)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, cwd=REPO, env=env, start_new_session=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the terminal's other side closed, the program is done
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        else:
            proc.kill()
            raise AssertionError("etrain run did not finish in time:\n" + b"".join(chunks).decode(errors="replace")[-3000:])
    finally:
        os.close(master)
    return proc.wait(60), b"".join(chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def tty_and_piped(ray_local, tmp_path_factory):
    """(rc, output) of `etrain run` in a terminal, and the same run piped (rc, stdout, stderr), run at once."""
    env, folder = environment(ray_local), tmp_path_factory.mktemp("console")
    with open(folder / "piped.out", "w") as out, open(folder / "piped.err", "w") as err:
        piped = subprocess.Popen(command(folder / "piped-root", "piped"), stdout=out, stderr=err, cwd=REPO, env=env)
        try:
            tty = run_in_terminal(command(folder / "tty-root", "tty"), env)
            piped.wait(300)
        finally:
            if piped.poll() is None:
                piped.kill()
                piped.wait(60)
    return SimpleNamespace(tty=tty, piped=SimpleNamespace(returncode=piped.returncode,
                                                          stdout=(folder / "piped.out").read_text(),
                                                          stderr=(folder / "piped.err").read_text()))


def test_on_a_terminal_progress_is_one_live_line_and_ray_is_quiet(tty_and_piped):
    code, raw = tty_and_piped.tty
    text = strip_ansi(raw)
    assert code == 0, text[-3000:]
    steps = [int(m.group(1)) for m in LIVE_LINE.finditer(text)]
    assert steps and steps[-1] == 30, text[-3000:]
    assert "\x1b[?25l" in raw and "\x1b[2K" in raw  # a live display: cursor hidden, its line redrawn in place
    assert not re.search(r"^\[etrain\] step \d+/30", text, re.M)  # the progress lines went into the bar
    assert "TrainingReport(" not in text and "RayTrainWorker" not in text
    assert Console.HIDDEN_HINT in text  # there was chatter, and it was hidden
    assert "[etrain] job 'tty': storage" in text and "[etrain] job tty: succeeded at step 30/30" in text


def test_without_a_terminal_progress_is_plain_lines(tty_and_piped):
    proc = tty_and_piped.piped
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    lines = proc.stdout.splitlines()
    progress = [line for line in lines if line.startswith("[etrain] step ")]
    assert [line.split()[2] for line in progress] == ["5/30", "10/30", "15/30", "20/30", "25/30", "30/30"], lines
    assert all(re.fullmatch(r"\[etrain\] step \d+/30 \(\d+%\) loss \d+\.\d{4} lr \S+ \d+ samples/s eta \S+", p)
               for p in progress), progress
    assert "\x1b" not in proc.stdout and "TrainingReport(" not in proc.stdout + proc.stderr
    assert Console.HIDDEN_HINT in proc.stdout


def test_verbose_shows_rays_own_lines(ray_local, tmp_path):
    proc = subprocess.run(command(tmp_path, "verbose", "--verbose", "--stop-at-step", "10"), capture_output=True,
                          text=True, cwd=REPO, env=environment(ray_local), timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-3000:]  # stopped early on purpose, resumable
    assert re.search(r"^\(RayTrainWorker pid=\d+\) Reporting training result 1: TrainingReport\(", out, re.M), out[-3000:]
    assert "[etrain] step 10/30" in out and Console.HIDDEN_HINT not in out


def test_ctrl_c_stops_with_a_checkpoint_and_says_how_to_resume(ray_local, tmp_path):
    """The first Ctrl-C is a graceful stop, as SIGTERM is (Ray Train's own handler, which aborts the
    run at once and exits 1 without a word, only comes second)."""
    import json
    import signal

    cmd = command(tmp_path, "interrupted") + ["--set", "training.max_steps=1000000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=environment(ray_local), start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:  # training is under way once a progress line is out
            lines.append(line)
            if line.startswith("[etrain] step "):
                break
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines) + rest
    assert proc.returncode == 3, out[-3000:]  # stopped, resumable
    assert "[etrain] Ctrl-C: stopping at the next log step with a checkpoint" in out, out[-3000:]
    assert "Traceback" not in out
    summary = json.loads((tmp_path / "interrupted" / "summary.json").read_text())
    assert summary["status"] == "stopped" and 0 < summary["final_step"] < 1000000, summary
    assert summary["checkpoint_uri"].endswith(f"checkpoint_{summary['final_step']:09d}"), summary
