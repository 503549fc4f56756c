"""The workers' logger: rank 0's lines, other ranks' only from WARNING (marked), the level from the CLI."""

from __future__ import annotations

import pytest

from trainers.console import parse_progress, progress_text
from trainers.worker_log import LOG_LEVEL_ENV, worker_log, worker_logger


def lines(capsys) -> list[str]:
    return capsys.readouterr().out.splitlines()


def test_rank_zero_prints_its_lines_with_our_mark(capsys):
    log = worker_logger(0, "info")
    log.info(progress_text(10, 40, 0.5, 1e-3, 1000.0, 0.0, 65))
    log.debug("hidden at info")
    (line,) = lines(capsys)
    assert line.startswith("[etrain] step 10/40") and parse_progress(line).step == 10


def test_other_ranks_print_only_warnings_and_say_which_rank(capsys):
    log = worker_logger(3, "info")
    log.info("every rank has this; rank 0 says it")
    log.warning("only rank 3 saw this")
    assert lines(capsys) == ["[etrain] rank 3: only rank 3 saw this"]


@pytest.mark.parametrize("level, shown", [("warning", ["[etrain] w"]), ("info", ["[etrain] i", "[etrain] w"]),
                                          ("debug", ["[etrain] d", "[etrain] i", "[etrain] w"])])
def test_the_level_comes_from_the_environment(capsys, monkeypatch, level, shown):
    monkeypatch.setenv(LOG_LEVEL_ENV, level.upper())
    worker_logger(0)
    log = worker_log()  # module code outside the Trainer gets the same configured logger
    log.debug("d")
    log.info("i")
    log.warning("w")
    assert lines(capsys) == shown


def test_reconfiguring_a_reused_process_does_not_double_lines(capsys):
    worker_logger(1, "info")
    log = worker_logger(0, "info")
    log.info("once")
    assert lines(capsys) == ["[etrain] once"]
