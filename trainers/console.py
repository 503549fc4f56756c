"""What `etrain run` shows in a terminal: our lines, and on a TTY one live progress line.

Rank 0 prints a progress line at every log step (``progress_line``); Ray forwards it, with
every other line its workers and actors print, to the driver. The driver's ``Console`` takes
those lines from Ray (cluster.ray_adapter.logs.route_worker_logs) and shows:

- on a TTY, the progress lines as one live line (rich: step/target, loss, samples/s, ETA)
  and our other ``[etrain]`` lines above it;
- without a TTY, our lines as plain lines, as before;
- Ray's own lines (``Reporting training result ... TrainingReport(...)``, core-worker
  warnings, actor tracebacks) only with ``verbose`` (`--verbose`, `--log-level debug`).
"""

from __future__ import annotations

import re
import sys
import threading
from dataclasses import dataclass
from typing import TextIO

from cluster.log_lines import OURS

ANSI = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)|[@-Z\\-_])")
PROGRESS = re.compile(r"\[etrain\] step (?P<step>\d+)/(?P<target>\d+) \(\d+%\) loss (?P<loss>\S+) lr (?P<lr>\S+) "
                      r"(?P<samples>\d+) samples/s(?: (?P<tokens>\d+) tokens/s)? eta (?P<h>\d+):(?P<m>\d\d):(?P<s>\d\d)")


@dataclass(frozen=True)
class Progress:
    step: int
    target: int
    loss: float
    samples_per_s: float
    tokens_per_s: float | None
    eta_s: int


def hms(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def progress_text(step: int, target: int, loss: float, lr: float, samples_per_s: float, tokens_per_s: float,
                  eta_s: float) -> str:
    """The loop's message at a log step (the worker's logger puts ``[etrain]`` before it)."""
    return (f"step {step}/{target} ({100 * step / target:.0f}%) loss {loss:.4f} lr {lr:.2e} "
            f"{samples_per_s:.0f} samples/s" + (f" {tokens_per_s:.0f} tokens/s" if tokens_per_s else "")
            + f" eta {hms(eta_s)}")


def progress_line(*args) -> str:
    """The loop's line as printed; ``parse_progress`` reads it back on the driver."""
    return f"{OURS} {progress_text(*args)}"


def parse_progress(line: str) -> Progress | None:
    m = PROGRESS.search(line)
    if m is None:
        return None
    return Progress(step=int(m["step"]), target=int(m["target"]), loss=float(m["loss"]),
                    samples_per_s=float(m["samples"]), tokens_per_s=float(m["tokens"]) if m["tokens"] else None,
                    eta_s=int(m["h"]) * 3600 + int(m["m"]) * 60 + int(m["s"]))


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)


def ray_prefix(batch: dict) -> str:
    """Ray's own prefix for a forwarded line: ``(RayTrainWorker pid=123)``."""
    who = batch.get("actor_name") or batch.get("task_name") or ""
    return f"({who + ' ' if who else ''}pid={batch.get('pid')})"


class Console:
    """The driver's output while a job runs. Use as a context manager, with our lines sent to
    :meth:`say` (``cluster.log_lines.lines_to(console.say)``) around ``run_job``."""

    HIDDEN_HINT = f"{OURS} (Ray's own log lines are hidden: --verbose shows them)"

    def __init__(self, out: TextIO | None = None, live: bool | None = None, verbose: bool = False):
        self.out = out or sys.stdout
        self.live = self.out.isatty() if live is None else live
        self.verbose = verbose
        self._lock = threading.Lock()
        self._routed = False
        self._hinted = False
        self._bar = self._task = None

    def __enter__(self) -> "Console":
        if self.live:
            from rich.console import Console as RichConsole
            from rich.progress import BarColumn
            from rich.progress import Progress as Bar
            from rich.progress import TextColumn

            self._bar = Bar(TextColumn("step {task.completed:.0f}/{task.fields[target]}"), BarColumn(),
                            TextColumn("{task.percentage:>3.0f}%"), TextColumn("{task.fields[stats]}"),
                            console=RichConsole(file=self.out), transient=False)  # stray prints go above it
            self._task = self._bar.add_task("train", total=None, target="?", stats="starting")
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        """Stop the live line. Ray's lines stay routed here: it forwards a run's last ones (the
        controller's teardown) after the run returns, and they are still chatter."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    # ------------------------------------------------------------ what the launcher says

    def say(self, text: str) -> None:
        """A line from the launcher. It speaks only once Ray is up, so the first line also takes
        over Ray's forwarding of worker lines."""
        self._route_worker_lines()
        progress = parse_progress(text)
        if progress is not None and self._bar is not None:
            self._show_progress(progress)
        else:
            self._print(text)

    def _route_worker_lines(self) -> None:
        import ray

        if not self._routed and ray.is_initialized():
            from cluster.ray_adapter.logs import route_worker_logs

            route_worker_logs(self.worker_lines)
            self._routed = True

    # ------------------------------------------------------------ what Ray forwards

    def worker_lines(self, batch: dict) -> None:
        """A batch of lines Ray forwarded from one worker or actor."""
        lines = batch.get("lines", [])
        if batch.get("pid") == "autoscaler":  # its status dump every few seconds: only its events count
            from cluster.ray_adapter.logs import autoscaler_events

            lines = autoscaler_events(lines)
        for line in lines:
            line = strip_ansi(line).rstrip()
            if OURS in line:
                self.say(line[line.index(OURS):])
            elif self.verbose:
                self._print(f"{ray_prefix(batch)} {line}", err=bool(batch.get("is_err")))
            elif line.strip() and not self._hinted:
                self._hinted = True
                self._print(self.HIDDEN_HINT)

    # ------------------------------------------------------------ output

    def _show_progress(self, p: Progress) -> None:
        stats = f"loss {p.loss:.4f}  {p.samples_per_s:.0f} samples/s"
        if p.tokens_per_s:
            stats += f"  {p.tokens_per_s:.0f} tokens/s"
        self._bar.update(self._task, completed=p.step, total=p.target, target=p.target,
                         stats=f"{stats}  eta {hms(p.eta_s)}")

    def _print(self, text: str, err: bool = False) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.console.print(text, markup=False, highlight=False, emoji=False)
            else:
                print(text, file=sys.stderr if err and self.out is sys.stdout else self.out, flush=True)
