"""One format for our lines (cluster/log_lines.py): the tag by logger, "note:" and "error:" by
level, a rank other than 0 named, and the front end deciding where lines go."""

from __future__ import annotations

import io
import logging

import pytest

from cluster.log_lines import LineFormatter, lines_to, send_to, tag_of


@pytest.mark.parametrize("name, tag", [
    ("trainers.launch", "[etrain]"), ("cluster.spot", "[spot-watch]"), ("cluster.spot.watch", "[spot-watch]"),
    ("cluster.rehearsal.cloud", "[rehearsal]"), ("service.submit", "[etrain-service]"), ("cluster.storage", "[etrain]"),
])
def test_a_lines_tag_comes_from_its_logger(name, tag):
    assert tag_of(name) == tag


@pytest.mark.parametrize("level, line", [
    (logging.INFO, "[etrain] job started"), (logging.WARNING, "[etrain] note: job started"),
    (logging.ERROR, "[etrain] error: job started"),
])
def test_the_level_is_said_in_words(level, line):
    record = logging.LogRecord("trainers.launch", level, __file__, 1, "job %s", ("started",), None)
    assert LineFormatter().format(record) == line


def test_a_workers_line_names_a_rank_other_than_zero_and_no_level():
    record = logging.LogRecord("etrain.worker", logging.WARNING, __file__, 1, "skipping", (), None)
    record.rank_mark = "rank 1: "
    assert LineFormatter(levels=False).format(record) == "[etrain] rank 1: skipping"


def test_lines_go_where_the_front_end_says_and_back_when_it_is_done():
    seen: list[str] = []
    log = logging.getLogger("trainers.some_module")
    with lines_to(seen.append):
        log.info("one")
        logging.getLogger("cluster.spot").warning("drain failed")
        logging.getLogger("trainers.x").debug("hidden at INFO")
    log.info("after")
    assert seen == ["[etrain] one", "[spot-watch] note: drain failed"]
    out = io.StringIO()
    restore = send_to(out)
    try:
        logging.getLogger("service.submit").error("refused")
    finally:
        restore()
    assert out.getvalue() == "[etrain-service] error: refused\n"
    assert logging.getLogger("service").handlers == [] and logging.getLogger("service").propagate
