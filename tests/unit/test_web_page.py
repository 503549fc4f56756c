"""The page's readings of a job: the log as lines by source and level, progress and ETA, the
jobs list's filter, every value a job wrote escaped; and what `etrain run` shows in a terminal."""

from __future__ import annotations

import io
import json

import pytest

from service import web
from trainers.console import Console, hms, parse_progress, progress_line, strip_ansi

RAY_LOG = (
    "2026-11-30 19:54:11,194\tWARNING authentication_token_setup.py:85 -- Token authentication is enabled\n"
    "[etrain] job 'j': storage j-1, data datasets/digits-v1.parquet\n"
    "\x1b[36m(RayTrainWorker pid=28108)\x1b[0m [etrain] step 10/40 (25%) loss 2.1944 lr 2.85e-03 4628 samples/s eta 0:00:00\n"
    "\x1b[36m(RayTrainWorker pid=28108)\x1b[0m Reporting training result 1: TrainingReport(checkpoint=None)\n"
    "\x1b[36m(TrainController pid=27510)\x1b[0m [2026-11-30 19:55:15,752 E 27510 27696] core_worker.cc:2465: Actor\n"
    "\x1b[36m(PlacementGroupCleaner pid=27997)\x1b[0m Traceback (most recent call last):\n"
    "\x1b[36m(PlacementGroupCleaner pid=27997)\x1b[0m   File \"x.py\", line 1, in <module>\n"
    "\x1b[36m(PlacementGroupCleaner pid=27997)\x1b[0m ConnectionError: Found multiple active Ray instances\n"
    "(pid=autoscaler) Resources\n"
    "hello from the user's driver\n"
)


def test_the_log_loses_its_escape_codes_and_says_whose_each_line_is():
    lines = web.log_lines(RAY_LOG)
    assert not any("\x1b" in line["text"] or "[36m" in line["text"] for line in lines)
    assert [(line["source"], line["level"]) for line in lines] == [
        ("ray", "warning"), ("etrain", "info"), ("etrain", "info"), ("ray", "info"), ("ray", "error"),
        ("ray", "error"), ("ray", "error"), ("ray", "error"), ("ray", "info"), ("other", "info")]
    assert lines[2]["text"].startswith("[etrain] step 10/40")  # our line reads the same from any worker
    assert lines[3]["text"] == "(RayTrainWorker pid=28108) Reporting training result 1: TrainingReport(checkpoint=None)"


def test_the_page_log_shows_ours_and_problems_by_default():
    page = web.job_page({"id": "j-0123456789ab", "name": "n", "state": "RUNNING"}, [], [], [], RAY_LOG)
    assert '<pre id="log" class="log src-default lvl-all">' in page
    assert '<span class="line src-ray lvl-info">(RayTrainWorker pid=28108) Reporting' in page
    assert "\x1b" not in page


@pytest.mark.parametrize("rows,target,expected", [
    ([], 100, None),
    ([{"time": 10.0, "step": 10}], 100, None),  # one point has no pace
    ([{"time": 10.0, "step": 10}, {"time": 20.0, "step": 20}], 100, 80.0),
    ([{"time": 10.0, "step": 10}, {"time": 20.0, "step": 100}], 100, 0.0),
    ([{"time": 10.0, "step": 10}, {"time": "x", "step": 20}, {"time": 20.0, "step": 20}], 100, 80.0),
])
def test_eta_follows_the_latest_pace(rows, target, expected):
    assert web.eta_s(rows, target) == (pytest.approx(expected) if expected is not None else None)


def test_eta_uses_only_the_attempt_after_a_restart():
    # Crashed after step 50 (t=5), restored from step 30: steps 40, 50, 60 done again at t=100..120.
    rows = [{"time": 1.0, "step": 10}, {"time": 2.0, "step": 20}, {"time": 3.0, "step": 30},
            {"time": 100.0, "step": 40}, {"time": 110.0, "step": 50}, {"time": 120.0, "step": 60}]
    assert web.eta_s(rows, 100, since_step=30) == pytest.approx(40 * 20 / 20)
    assert web.eta_s(rows, 100) == pytest.approx(40 * 119 / 50)  # without knowing the restart: the downtime counts
    # A row older than the one after it ends the window too (steps done again, a later row kept for each).
    assert web.eta_s([{"time": 1.0, "step": 10}, {"time": 50.0, "step": 20}, {"time": 40.0, "step": 30},
                      {"time": 60.0, "step": 40}], 100) == pytest.approx(60 * 20 / 10)
    running = {"state": "RUNNING", "spec": {"training": {"max_steps": 100}}}
    assert web.progress_of(running, rows, [{"restored_step": 30}])["eta_s"] == pytest.approx(40.0)


def test_progress_comes_from_the_latest_row_else_the_summary_else_the_spec():
    running = {"state": "RUNNING", "summary": None, "spec": {"training": {"max_steps": 50}}}
    p = web.progress_of(running, [{"time": 1.0, "step": 10, "target_step": 40, "goodput": 0.5},
                                  {"time": 2.0, "step": 20, "target_step": 40, "cost_usd": 0.25}])
    assert (p["step"], p["target_step"], p["fraction"], p["eta_s"], p["cost_usd"]) == (20, 40, 0.5, 2.0, 0.25)
    done = {"state": "SUCCEEDED", "summary": {"final_step": 40, "target_step": 40, "goodput": 0.7}, "spec": {}}
    p = web.progress_of(done, [])
    assert (p["step"], p["fraction"], p["eta_s"], p["goodput"]) == (40, 1.0, None, 0.7)
    assert web.progress_of({"state": "PENDING", "spec": {"training": {"max_steps": 50}}}, [])["target_step"] == 50


def test_the_jobs_list_filters_by_state_and_shows_age_cost_and_progress():
    rows = [{"id": "j-000000000001", "name": "a", "kind": "job", "state": "RUNNING", "created_at": 1000.0,
             "updated_at": 1000.0, "progress": {"step": 30, "target_step": 60, "fraction": 0.5, "goodput": 0.8,
                                                "cost_usd": 1.5, "eta_s": 90}},
            {"id": "j-000000000002", "name": "b", "kind": "job", "state": "FAILED", "created_at": 1000.0,
             "updated_at": 1000.0, "progress": {}}]
    html = web.jobs_table(rows, "RUNNING", now=1000.0 + 7500)
    assert "j-000000000001" in html and "j-000000000002" not in html
    assert '<progress class="bar" value="30" max="60">' in html and "80%" in html and "$1.50" in html
    assert "2 h 5 min" in html and "1 min 30 s" in html
    assert 'href="/?state=FAILED"' in html and 'class="count">1<' in html
    assert "No succeeded jobs." in web.jobs_table(rows, "SUCCEEDED")


@pytest.mark.parametrize("seconds,text", [(None, "-"), (5, "5 s"), (75, "1 min 15 s"), (1800, "30 min"),
                                          (7500, "2 h 5 min"), (90000, "1 d 1 h")])
def test_durations_read_as_a_person_says_them(seconds, text):
    assert web.duration(seconds) == text


def test_only_the_service_files_are_served():
    body, media_type = web.static_file("vendor/uplot/uPlot.iife.min.js")
    assert media_type == "text/javascript" and body.startswith(b"/*! https://github.com/leeoniya/uPlot")
    assert b"MIT License" in web.static_file("vendor/uplot/LICENSE")[0]
    assert web.static_file("../web.py") is None and web.static_file("templates/job.html") is None


def test_the_policy_allows_script_from_the_service_only():
    directives = dict(d.strip().split(" ", 1) for d in web.CSP.split(";"))
    assert directives["script-src"] == "'self'" and directives["default-src"] == "'none'"
    assert "unsafe" not in web.CSP and "http" not in web.CSP


def test_the_page_escapes_every_value_a_job_wrote():
    evil = "<img src=x onerror=window.__pwned=1>"
    record = {"id": "j-0123456789ab", "name": evil, "state": "RUNNING"}
    rows = [{"time": 1.0, "step": evil, "world_size": evil, "loss": evil, "samples_per_s": 1.0},
            {"time": 2.0, "step": 2, "world_size": evil, "loss": 0.5, "samples_per_s": 2.0, "goodput": evil}]
    html = web.job_page(record, rows, [{"cause": evil, "interrupted_at": evil, "steps_lost": evil, "recovery_s": evil}],
                        [{"step": evil, "complete": True, "size_bytes": evil, "uri": evil}], evil)
    assert "<img" not in html and html.count("&lt;img src=x onerror=window.__pwned=1&gt;") >= 7
    data = web.job_data(record, rows, [{"cause": evil, "step_reached": 3, "world_size_before": evil}], [], evil)
    assert "<img" not in json.dumps(data["html"])  # the script puts these parts in as HTML: escaped here
    assert data["chart"]["interruptions"][0]["cause"] == evil  # labels are data; the script sets them as text
    listing = web.jobs_page(evil, [{"id": evil, "name": evil, "kind": "job", "state": evil, "created_at": evil,
                                    "progress": {"step": evil, "target_step": 3, "goodput": evil}, "updated_at": evil}])
    assert "<img" not in listing


# ---------------------------------------------------------------- the console


def test_the_progress_line_reads_back():
    line = progress_line(120, 400, 0.123456, 2.5e-4, 1234.4, 0.0, 3725)
    assert line == "[etrain] step 120/400 (30%) loss 0.1235 lr 2.50e-04 1234 samples/s eta 1:02:05"
    p = parse_progress("(RayTrainWorker pid=1) " + line)
    assert (p.step, p.target, p.loss, p.samples_per_s, p.tokens_per_s, p.eta_s) == (120, 400, 0.1235, 1234, None, 3725)
    assert parse_progress(progress_line(1, 2, 1.0, 1e-3, 10, 5000, 0)).tokens_per_s == 5000
    assert parse_progress("[etrain] resumed from step 5") is None and hms(59) == "0:00:59"


def batch(*lines, actor="RayTrainWorker", is_err=False):
    return {"lines": list(lines), "actor_name": actor, "pid": 7, "is_err": is_err}


def test_plain_console_shows_our_lines_and_hides_rays_with_one_hint():
    out = io.StringIO()
    with Console(out, live=False) as console:
        console.worker_lines(batch("\x1b[32m[etrain] step 10/40 (25%) loss 2.1944 lr 2.85e-03 46 samples/s eta 0:00:01",
                                   "Reporting training result 1: TrainingReport(checkpoint=None)",
                                   "Reporting training result 2: TrainingReport(checkpoint=None)"))
        console.say("[etrain] note: hello")
    assert out.getvalue().splitlines() == [
        "[etrain] step 10/40 (25%) loss 2.1944 lr 2.85e-03 46 samples/s eta 0:00:01", Console.HIDDEN_HINT,
        "[etrain] note: hello"]


def test_verbose_console_shows_rays_lines_with_their_source():
    out = io.StringIO()
    with Console(out, live=False, verbose=True) as console:
        console.worker_lines(batch("Reporting training result 1: TrainingReport(checkpoint=None)", actor="", is_err=True))
    assert out.getvalue() == "(pid=7) Reporting training result 1: TrainingReport(checkpoint=None)\n"


def test_live_console_turns_progress_lines_into_one_bar():
    out = io.StringIO()
    with Console(out, live=True) as console:
        console.say("[etrain] job 'j': storage /r/j")
        console.worker_lines(batch("[etrain] step 10/40 (25%) loss 2.1944 lr 2.85e-03 46 samples/s eta 0:00:01"))
        console.worker_lines(batch("[etrain] step 20/40 (50%) loss 1.5000 lr 2.85e-03 48 samples/s eta 0:00:01"))
    text = strip_ansi(out.getvalue())
    assert "[etrain] job 'j': storage /r/j" in text
    assert "step 20/40" in text and "loss 1.5000  48 samples/s  eta 0:00:01" in text
    assert "[etrain] step 10/40" not in text  # consumed by the bar, not printed as a line


# ---------------------------------------------------------------- `etrain jobs list / get`


def record(i: int, **extra) -> dict:
    return {"id": f"j-{i:012x}", "name": "a-rather-long-job-name-that-would-not-fit-in-the-table", "tenant": "team-a",
            "state": "RUNNING", "created_at": 1000.0, "updated_at": 1100.0, "storage": f"j-{i:012x}",
            "submissions": ["s0", "s1"], "error": None, "history": [{"state": "RUNNING", "at": 1000.0, "reason": "x"}],
            "progress": {"step": 12000, "target_step": 20000, "goodput": 0.873, "cost_usd": 123.456, "eta_s": 4000,
                         "loss": 0.25}, **extra}


def test_jobs_list_fits_80_columns_and_cuts_only_the_name():
    from service.cli import table

    text = table([record(1), record(2, tenant="team-b", state="SUCCEEDED", progress={})], now=1000.0 + 3 * 86400 + 7200)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    assert lines[0].split() == ["ID", "NAME", "TENANT", "STATE", "PROGRESS", "GOODPUT", "COST", "AGE"]
    assert "j-000000000001" in lines[1] and "a-rath\u2026" in lines[1]
    assert "12k/20k 60%" in lines[1] and "87%" in lines[1] and "$123.46" in lines[1] and "3d02h" in lines[1]
    assert lines[2].split()[-4:] == ["-", "-", "-", "3d02h"]
    assert "TENANT" not in table([record(1)], now=1000.0)  # one tenant: no column for it


def test_a_tenants_text_reaches_an_admins_terminal_as_text(capsys):
    """A record stored before names were checked, or a log line: escape sequences print as visible
    escapes, never as the sequences (no cursor moves, no window title, no clipboard writes)."""
    import argparse

    from service.cli import _show, details, table

    evil = "x\x1b]0;owned\x07\x1b[2J\x9b31m\x00"
    for render in (lambda: table([record(1, name=evil)], now=1000.0), lambda: details(record(1, error=evil), 1060.0)):
        _show(argparse.Namespace(json=False), {}, render)
        out = capsys.readouterr().out
        assert not any(ord(c) < 32 and c not in "\n" or 0x7f <= ord(c) <= 0x9f for c in out), repr(out)
        assert "\\x1b" in out
    _show(argparse.Namespace(json=True), {"name": evil}, lambda: "")
    assert "\x1b" not in capsys.readouterr().out  # JSON escapes them itself
    from service.cli import ApiError

    rendered = ApiError(422, {"detail": "invalid spec", "problems": [f"name: {evil}: use lowercase"]}).render()
    assert "\x1b" not in rendered and "\\x1b" in rendered


def test_jobs_metrics_shows_a_hostile_row_as_dashes(monkeypatch, capsys):
    """The job writes its history: a row whose loss is text must not crash the admin's command."""
    from service import cli

    class Answer:
        def json(self):
            return {"id": "j-1", "rows": [{"step": 10, "loss": "<b>", "samples_per_s": None}, {"step": 20, "loss": 0.5,
                                                                                             "samples_per_s": 12.0}]}
    monkeypatch.setattr(cli.Client, "call", lambda self, *a, **k: Answer())
    assert cli.main(["jobs", "metrics", "j-1", "--token", "t"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["step      10  loss -  - samples/s", "step      20  loss 0.5000  12 samples/s"], out


def test_jobs_get_is_a_field_a_line_within_80_columns():
    from service.cli import details

    text = details(record(1, error="boom"), now=1060.0)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "progress:   12k/20k 60%" in text and "eta:        1h06m" in text and "goodput:    87%" in text
    assert "(1m00s ago)" in text and "attempts:   2" in text and "error:      boom" in text


def test_verbose_console_shows_only_the_autoscalers_events(monkeypatch):
    import cluster.ray_adapter.logs

    # Ray's own filter needs a connected Ray; here a stand-in that keeps what it would keep.
    monkeypatch.setattr(cluster.ray_adapter.logs, "autoscaler_events", lambda lines: [l for l in lines if "Adding" in l])
    out = io.StringIO()
    with Console(out, live=False, verbose=True) as console:
        console.worker_lines({"lines": ["======== Autoscaler status: 2026-11-30 ========", "Node status",
                                        "Adding 1 node(s) of type gpu_spot."], "pid": "autoscaler", "is_err": False})
    assert out.getvalue() == "(pid=autoscaler) Adding 1 node(s) of type gpu_spot.\n"
