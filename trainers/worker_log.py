"""Our lines from the training workers: the ``etrain.worker`` logger, leveled, rank 0 by default.

Every rank logs the same events; printing them all would repeat each line once per worker, so
only rank 0's lines below WARNING are printed, while a warning or error from any rank is
printed with its rank. Lines go to stdout as ``[etrain] message``: Ray forwards them to the
driver, whose console (trainers.console) shows ours and hides Ray's own. The level comes from
``ETRAIN_LOG_LEVEL`` (``etrain run --log-level``), INFO by default.
"""

from __future__ import annotations

import logging
import os
import sys

from trainers.console import OURS

LOGGER_NAME = "etrain.worker"
LOG_LEVEL_ENV = "ETRAIN_LOG_LEVEL"


class RankZeroFilter(logging.Filter):
    """Rank 0's lines; another rank's only from WARNING up, marked with the rank."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank_mark = "" if self.rank == 0 else f"rank {self.rank}: "
        return self.rank == 0 or record.levelno >= logging.WARNING


def worker_logger(rank: int, level: str | None = None) -> logging.Logger:
    """The logger of this worker process, (re)configured for ``rank`` (a process may be reused)."""
    log = logging.getLogger(LOGGER_NAME)
    for handler in list(log.handlers):
        log.removeHandler(handler)
    handler = logging.StreamHandler(sys.stdout)  # flushed at every line: Ray forwards it at once
    handler.setFormatter(logging.Formatter(f"{OURS} %(rank_mark)s%(message)s"))
    handler.addFilter(RankZeroFilter(rank))
    log.addHandler(handler)
    log.propagate = False  # Ray's own handlers on the root logger would print it a second time
    name = (level or os.environ.get(LOG_LEVEL_ENV) or "INFO").upper()
    log.setLevel(name if name in ("DEBUG", "INFO", "WARNING", "ERROR") else "INFO")  # a bad value is no job failure
    return log


def worker_log() -> logging.Logger:
    """The logger for code outside the Trainer object (background threads, module functions)."""
    return logging.getLogger(LOGGER_NAME)
