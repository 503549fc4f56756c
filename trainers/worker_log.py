"""Our lines from the training workers: the ``etrain.worker`` logger, leveled, rank 0 by default.

Every rank logs the same events; printing them all would repeat each line once per worker, so
only rank 0's lines below WARNING are printed, while a warning or error from any rank is
printed with its rank. Lines go to stdout as ``[etrain] message`` (cluster.log_lines): Ray forwards them to the
driver, whose console (trainers.console) shows ours and hides Ray's own. The level comes from
``ETRAIN_LOG_LEVEL`` (``etrain run --log-level``), INFO by default.
"""

from __future__ import annotations

import logging
import os
import sys

from cluster.log_lines import OUR_LOGGERS, LineFormatter

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
    """The logger of this worker process, (re)configured for ``rank`` (a process may be reused).
    Our library modules' loggers (retention, storage) print through the same handler."""
    handler = logging.StreamHandler(sys.stdout)  # flushed at every line: Ray forwards it at once
    handler.setFormatter(LineFormatter(levels=False))
    handler.addFilter(RankZeroFilter(rank))
    name = (level or os.environ.get(LOG_LEVEL_ENV) or "INFO").upper()
    for log in (logging.getLogger(LOGGER_NAME), *map(logging.getLogger, OUR_LOGGERS)):
        for old in list(log.handlers):
            log.removeHandler(old)
        log.addHandler(handler)
        log.propagate = False  # Ray's own handlers on the root logger would print it a second time
        log.setLevel(name if name in ("DEBUG", "INFO", "WARNING", "ERROR") else "INFO")  # a bad value is no job failure
    return logging.getLogger(LOGGER_NAME)


def worker_log() -> logging.Logger:
    """The logger for code outside the Trainer object (background threads, module functions)."""
    return logging.getLogger(LOGGER_NAME)
