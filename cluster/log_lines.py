"""Our lines, one format for every process: ``[etrain] message``, a warning ``[etrain] note:
message``, an error ``[etrain] error: message``.

Library modules log with ``logging.getLogger(__name__)`` and never configure handlers or print;
the command-line front ends decide where the lines go (:func:`send_to` a stream, or
:func:`lines_to` a function such as the console's live display). A line's tag comes from its
logger: the spot watcher's lines are ``[spot-watch]``, the rehearsed cloud's ``[rehearsal]``,
the service's ``[etrain-service]``, everything else ``[etrain]`` (the console and the service
find our lines among Ray's by that tag). A worker's lines carry the rank of a rank other than 0
(trainers.worker_log).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import TextIO

OURS = "[etrain]"
# Our top-level packages: their loggers are where the front ends attach a handler
OUR_LOGGERS = ("trainers", "cluster", "service")
TAGS = {"cluster.spot": "[spot-watch]", "cluster.rehearsal": "[rehearsal]", "service": "[etrain-service]"}
LEVEL_WORDS = {logging.WARNING: "note: ", logging.ERROR: "error: ", logging.CRITICAL: "error: "}


def tag_of(logger_name: str) -> str:
    """The tag of a logger's lines: the most specific entry of TAGS that is it or a parent of it."""
    parts = logger_name.split(".")
    for i in range(len(parts), 0, -1):
        tag = TAGS.get(".".join(parts[:i]))
        if tag:
            return tag
    return OURS


class LineFormatter(logging.Formatter):
    """``<tag> [rank N: ][note: |error: ]message``, and a traceback below when one is logged.
    ``levels``: say "note:" and "error:" (the workers' lines do not: their rank says whose)."""

    def __init__(self, levels: bool = True):
        super().__init__()
        self.levels = levels

    def format(self, record: logging.LogRecord) -> str:
        word = LEVEL_WORDS.get(record.levelno, "") if self.levels else ""
        line = f"{tag_of(record.name)} {getattr(record, 'rank_mark', '')}{word}{record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _CallbackHandler(logging.Handler):
    def __init__(self, callback: Callable[[str], None]):
        super().__init__()
        self.callback = callback

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.callback(self.format(record))
        except Exception:  # noqa: BLE001  (logging's own rule: a failing handler reports, never raises)
            self.handleError(record)


def _attach(handler: logging.Handler, level: int) -> Callable[[], None]:
    """Our loggers' lines go to ``handler`` alone (not also to Ray's or the root's handlers); the
    returned function puts back what was there."""
    handler.setFormatter(LineFormatter())
    before = []
    for name in OUR_LOGGERS:
        log = logging.getLogger(name)
        before.append((log, list(log.handlers), log.level, log.propagate))
        for h in list(log.handlers):
            log.removeHandler(h)
        log.addHandler(handler)
        log.setLevel(level)
        log.propagate = False

    def restore() -> None:
        for log, handlers, old_level, propagate in before:
            log.removeHandler(handler)
            for h in handlers:
                log.addHandler(h)
            log.setLevel(old_level)
            log.propagate = propagate

    return restore


def send_to(stream: TextIO | None = None, level: int = logging.INFO) -> Callable[[], None]:
    """A front end's lines to ``stream`` (stderr by default: stdout may be a command's JSON)."""
    return _attach(logging.StreamHandler(stream or sys.stderr), level)


@contextlib.contextmanager
def lines_to(callback: Callable[[str], None], level: int = logging.INFO) -> Iterator[None]:
    """While it lasts, each of our lines goes, formatted, to ``callback`` (and nowhere else)."""
    restore = _attach(_CallbackHandler(callback), level)
    try:
        yield
    finally:
        restore()
