"""Issue 44's front door, its pure parts: the log classifier stays linear on a tenant's hostile
lines, a sign-in from another site is refused, failed sign-ins are limited per address in
bounded memory, long histories are downsampled, the listing reads only a history's end,
one read serves everyone who asks at once, and the jobs list is paged."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from service import web
from service.front_door import LoginLimiter, SharedRead, cross_site_refusal, downsample

REPO = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------- the log classifier


HOSTILE_LINES = {
    "a run of word characters": "a" * 400_000,
    "Warning words back to back": "Warning" * 60_000,
    "an unterminated escape": "\x1b]" + "a" * 400_000,
    "a Ray prefix that never closes": "(" + "a " * 200_000,
    "a dotted name that never ends in Error": "a" + "." * 400_000,
    "a progress line with a huge loss": "[etrain] step 1/2 (50%) loss " + "x" * 400_000,
}


@pytest.mark.parametrize("name", sorted(HOSTILE_LINES))
def test_a_hostile_log_line_is_classified_in_linear_time(name):
    """Each line is ~400k characters; a quadratic pattern (the old ``\\w+Warning: ``) takes minutes
    on the first two. A subprocess, so a regression fails by its timeout instead of hanging the suite."""
    code = ("import sys; from service import web; line = sys.stdin.read(); "
            "print(web.log_lines(line + '\\n' + line + ' UserWarning: x')[-1]['level'])")
    done = subprocess.run([sys.executable, "-c", code], input=HOSTILE_LINES[name], capture_output=True, text=True,
                          cwd=REPO, timeout=10)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "warning"


OLD_WARNING_WORDS = re.compile(r"\bWARN(ING)?\b|\w+Warning: ")  # the quadratic one, as the reference


@pytest.mark.parametrize("line", [
    "DeprecationWarning: x", "  warnings.warn: UserWarning: careful", "Warning: no word before it", "WARN disk",
    "WARNING: low", "WARNINGS here", "a_Warning: b", "xWarning:no space", "foo.BarWarning: baz", "plain info",
    "Warning", "(pid=1) RuntimeWarning: y"])
def test_the_linear_warning_pattern_classifies_as_the_old_one(line):
    assert bool(web.WARNING_WORDS.search(line)) == bool(OLD_WARNING_WORDS.search(line))
    assert web.log_lines(line)[0]["level"] == ("warning" if OLD_WARNING_WORDS.search(line) else "info")


# ---------------------------------------------------------------- sign-in from another site


@pytest.mark.parametrize("headers,refused", [
    ({"host": "127.0.0.1:8000"}, None),  # curl: no Origin, no Sec-Fetch-Site
    ({"host": "127.0.0.1:8000", "origin": "http://127.0.0.1:8000", "sec-fetch-site": "same-origin"}, None),
    ({"host": "svc.example.com", "origin": "https://svc.example.com"}, None),  # behind a TLS proxy
    ({"host": "svc.example.com:443", "origin": "https://SVC.example.com"}, None),
    ({"host": "127.0.0.1:8000", "sec-fetch-site": "cross-site"}, "Sec-Fetch-Site: cross-site"),
    ({"host": "127.0.0.1:8000", "sec-fetch-site": "same-site", "origin": "http://127.0.0.1:8000"},
     "Sec-Fetch-Site: same-site"),  # another port or subdomain of this site: still not this page
    # Our page's own form, as Chromium posts it under Referrer-Policy: no-referrer.
    ({"host": "127.0.0.1:8000", "origin": "null", "sec-fetch-site": "same-origin"}, None),
    ({"host": "127.0.0.1:8000", "origin": "null", "sec-fetch-site": "cross-site"}, "Sec-Fetch-Site: cross-site"),
    ({"host": "127.0.0.1:8000", "origin": "http://evil.example"}, "origin 'http://evil.example' is refused"),
    ({"host": "127.0.0.1:8000", "origin": "http://127.0.0.1:9000"}, "origin 'http://127.0.0.1:9000' is refused"),
    ({"host": "127.0.0.1:8000", "origin": "null"}, "origin 'null' is refused"),
    ({"host": "127.0.0.1:8000", "origin": "http://127.0.0.1:bad"}, "is refused"),
    ({"origin": "http://127.0.0.1:8000"}, "is refused"),  # no Host to match
])
def test_a_sign_in_from_another_site_is_refused(headers, refused):
    reason = cross_site_refusal(headers)
    if refused is None:
        assert reason is None
    else:
        assert reason is not None and refused in reason and "sign" in reason


# ---------------------------------------------------------------- failed sign-ins


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_failed_sign_ins_are_limited_per_address_over_a_sliding_window():
    clock = Clock()
    limiter = LoginLimiter(max_failures=3, window_s=60, max_addresses=100, clock=clock)
    for _ in range(3):
        assert limiter.retry_after_s("10.0.0.1") is None
        limiter.failed("10.0.0.1")
        clock.now += 10
    assert limiter.retry_after_s("10.0.0.1") == 30  # the first failure leaves the window at 1060
    assert limiter.retry_after_s("10.0.0.2") is None  # another address is not held back
    clock.now = 1060.5
    assert limiter.retry_after_s("10.0.0.1") is None
    clock.now = 2000.0
    assert limiter.retry_after_s("10.0.0.1") is None and len(limiter) == 0  # forgotten once nothing is recent


def test_the_limiter_forgets_the_oldest_addresses_beyond_its_bound():
    clock = Clock()
    limiter = LoginLimiter(max_failures=2, window_s=60, max_addresses=50, clock=clock)
    limiter.failed("victim")
    limiter.failed("victim")
    for i in range(10_000):  # an attacker with many addresses
        limiter.failed(f"10.1.{i // 256}.{i % 256}")
        assert len(limiter) <= 50
    assert len(limiter) == 50
    limiter.failed("10.1.39.15")  # a recent one is still counted: its second failure blocks it
    assert limiter.retry_after_s("10.1.39.15") == 60


# ---------------------------------------------------------------- long histories


def test_downsampling_keeps_first_last_and_even_spacing():
    rows = list(range(50_000))
    kept = downsample(rows, 2000)
    assert len(kept) == 2000 and kept[0] == 0 and kept[-1] == 49_999
    gaps = {b - a for a, b in zip(kept, kept[1:])}
    assert gaps <= {25, 26}
    assert downsample(rows[:10], 2000) == rows[:10] and downsample(rows[:3], 2) == [0, 2]


def write_history(folder: Path, files: list[tuple[list[int], float]], junk: bool = False) -> None:
    """Files as MetricsHistory.write names them: each a run of steps at times from ``t0``."""
    folder.mkdir(parents=True, exist_ok=True)
    for steps, t0 in files:
        rows = [{"time": t0 + i, "step": s, "loss": 1.0 / (s + 1)} for i, s in enumerate(steps)]
        name = f"{steps[0]:010d}-{steps[-1]:010d}-{int(rows[-1]['time'] * 1000)}.jsonl"
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows) + ("not json\n" if junk else ""))


def test_the_history_tail_is_the_end_of_the_whole_history(tmp_path):
    from cluster.storage import open_root
    from trainers.history import TAIL_BYTES, read_history, read_history_tail

    root = open_root(str(tmp_path))
    # Three attempts: steps 0..39 at t=0.., a restart from 30 re-doing 31..59, and one long last file
    # whose head is beyond what the tail reads.
    write_history(tmp_path / "j" / "metrics", [(list(range(0, 20)), 0.0), (list(range(20, 40)), 100.0),
                                               (list(range(31, 60)), 1000.0)], junk=True)
    long_steps = list(range(60, 60 + TAIL_BYTES // 20))
    write_history(tmp_path / "j" / "metrics", [(long_steps, 5000.0)])
    whole = read_history(root, "j")
    for n in (1, 16, 100):
        assert read_history_tail(root, "j", n) == whole[-n:]
    assert read_history_tail(root, "j", 16)[-1]["step"] == long_steps[-1]
    write_history(tmp_path / "k" / "metrics", [(list(range(0, 40)), 0.0), (list(range(31, 60)), 1000.0)])
    redone = read_history_tail(root, "k", 40)  # reaches into the steps done again: the later rows win
    assert redone == read_history(root, "k")[-40:] and [r["time"] for r in redone if r["step"] == 35] == [1004.0]
    assert read_history_tail(root, "none", 16) == []


class CountingFs:
    """The storage's filesystem, counting the files opened."""

    def __init__(self, fs):
        self.fs, self.opened = fs, []

    def __getattr__(self, name):
        return getattr(self.fs, name)

    def open_input_file(self, path):
        self.opened.append(path)
        return self.fs.open_input_file(path)


def test_the_history_tail_reads_only_the_files_it_needs(tmp_path):
    from cluster.storage import open_root
    from trainers.history import read_history_tail

    write_history(tmp_path / "j" / "metrics", [(list(range(s, s + 10)), float(s)) for s in range(0, 50_000, 10)])
    real = open_root(str(tmp_path))
    root = dataclasses.replace(real, fs=CountingFs(real.fs))
    opened = root.fs.opened
    rows = read_history_tail(root, "j", 16)
    assert [r["step"] for r in rows] == list(range(49_984, 50_000))
    assert len(opened) == 2  # of 5,000 files


# ---------------------------------------------------------------- one read for everyone


def test_a_shared_read_is_done_once_however_many_ask_at_once():
    clock, reads, gate = Clock(), [], threading.Event()

    def read():
        reads.append(1)
        gate.wait(5)
        return "log text"
    shared = SharedRead(ttl_s=2.0, clock=clock)
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(shared.get("sid", read))) for _ in range(20)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(10)
    assert answers == ["log text"] * 20 and len(reads) == 1
    clock.now += 2.5
    assert shared.get("sid", read) == "log text" and len(reads) == 2  # read again once it is old


def test_a_shared_read_shares_its_error_for_the_moment_and_stays_bounded():
    clock, calls = Clock(), []

    def failing():
        calls.append(1)
        raise RuntimeError("Ray is away")
    shared = SharedRead(ttl_s=2.0, max_keys=3, clock=clock)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="Ray is away"):
            shared.get("sid", failing)
    assert len(calls) == 1
    for i in range(10):
        shared.get(i, lambda: i)
    assert len(shared._entries) == 3 and len(shared._locks) <= 4


def test_a_shared_read_lets_go_of_what_is_past_its_moment():
    """A big answer (a history) read once must not stay held: entries older than the ttl go at the next read."""
    clock = Clock()
    shared = SharedRead(ttl_s=2.0, clock=clock)
    shared.get("big", lambda: "x" * 1000)
    clock.now += 3
    shared.get("other", lambda: "y")
    assert list(shared._entries) == ["other"]


# ---------------------------------------------------------------- what a tenant's job writes, read bounded


def test_files_a_tenant_writes_are_read_bounded_and_a_hostile_one_reads_as_absent(tmp_path):
    """A job (so its tenant) writes its summary, interruptions and history: nested past the parser's
    depth, oversized or full of junk, each reads as nothing, costs a bounded read, and breaks no listing."""
    import json as json_

    from cluster.storage import open_root
    from service.views import TENANT_JSON_MAX_BYTES, read_tenant_json
    from trainers import history

    root = open_root(str(tmp_path))
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "j" / "big.json").write_text(json_.dumps({"pad": "x" * TENANT_JSON_MAX_BYTES}))
    (tmp_path / "j" / "fine.json").write_text('{"status": "succeeded"}')
    assert read_tenant_json(root, "j", "deep.json") is None
    assert read_tenant_json(root, "j", "big.json") is None
    assert read_tenant_json(root, "j", "missing.json") is None
    assert read_tenant_json(root, "j", "fine.json") == {"status": "succeeded"}

    metrics = tmp_path / "j" / "metrics"
    metrics.mkdir()
    for i in range(3):  # three files of 10 rows; a budget of two files' bytes reads the newest two
        rows = "".join(json_.dumps({"step": 10 * i + k, "time": 1.0}) + "\n" for k in range(10))
        (metrics / f"{10 * i:010d}-{10 * i + 9:010d}-1.jsonl").write_text(rows)
    newest_two = sum((metrics / f"{10 * i:010d}-{10 * i + 9:010d}-1.jsonl").stat().st_size for i in (1, 2))
    assert [r["step"] for r in history.read_history(root, "j", max_bytes=newest_two)] == list(range(10, 30))
    assert len(history.read_history(root, "j")) == 30
    for i in range(400):  # files of no valid rows, named as the job names them, each ~1 KB
        (metrics / f"{1000 + i:010d}-{1000 + i:010d}-1.jsonl").write_text("junk\n" * 200)
    read = []
    real_open = root.fs.open_input_file

    class Counting:
        def __getattr__(self, name):
            return getattr(root.fs, name)

        def open_input_file(self, path):
            read.append(path)
            return real_open(path)
    counted = type(root)(uri=root.uri, fs=Counting(), base=root.base)
    history.TAIL_BUDGET_BYTES, saved = 64 * 1024, history.TAIL_BUDGET_BYTES
    try:
        assert history.read_history_tail(counted, "j", 16) == []
    finally:
        history.TAIL_BUDGET_BYTES = saved
    assert len(read) <= 64 * 1024 // 1000 + 1  # the budget (64 KiB of 1 KB files) stops it, not the 403 files


# ---------------------------------------------------------------- the jobs list, paged


def test_the_jobs_list_is_paged_and_reads_progress_for_the_shown_rows_only():
    rows = [{"id": f"j-{i:012x}", "name": f"n{i}", "kind": "job", "state": "RUNNING" if i % 2 else "FAILED",
             "created_at": 1000.0 - i, "updated_at": 1000.0} for i in range(130)]
    asked = []

    def progress(row):
        asked.append(row["id"])
        return {"step": 1, "target_step": 2, "fraction": 0.5}
    html = web.jobs_table(rows, None, now=1000.0, page=2, page_rows=50, progress=progress)
    assert asked == [r["id"] for r in rows[50:100]]
    assert "j-000000000032" in html and "j-000000000031" not in html and "j-000000000064" not in html
    assert "page 2 of 3" in html and 'href="/?page=1"' in html and 'href="/?page=3"' in html
    assert 'class="count">130<' in html  # counts cover every row
    asked.clear()
    html = web.jobs_table(rows, "RUNNING", now=1000.0, page=99, page_rows=50, progress=progress)
    assert len(asked) == 15 and "page 2 of 2" in html and 'href="/?state=RUNNING&amp;page=1"' in html
    assert "pages" not in web.jobs_table(rows[:3], None, page_rows=50, progress=progress)


# ---------------------------------------------------------------- docs and flags


def test_the_docs_page_lists_the_routes_without_any_script():
    from service.app import app

    html = web.docs_page(app.openapi())
    assert "<script" not in html and "cdn." not in html
    assert "<code>/v1/jobs/{record_id}/metrics</code>" in html and "Submit a job spec (JSON or YAML)" in html
    assert 'href="/openapi.json"' in html


def test_serve_flags_set_the_limits_and_name_the_flag_when_wrong():
    from service.cli import HTTP_FLAGS, http_limits, main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    args = type("Args", (), {field: None for field, _, _ in HTTP_FLAGS.values()})()
    args.body_deadline_s, args.max_queued_requests = 3.0, 7
    limits = http_limits(args)
    assert (limits.body_deadline_s, limits.max_queued_requests, limits.max_ongoing_requests) == (3.0, 7, 1000)
    args.max_metrics_points = 1
    with pytest.raises(ValueError, match=r"--max-metrics-points 1: Input should be greater than or equal to 2"):
        http_limits(args)


# ---------------------------------------------------------------- followed logs per tenant


@pytest.mark.parametrize("pickled", [False, True])
def test_a_tenant_follows_only_so_many_logs_at_once(tmp_path, pickled):
    """Each followed log holds a request slot until it ends: one token must not take them all.
    ``pickled``: the route as Serve ships it to the replica (cloudpickle copies a route made in a
    function by value, with the globals it names): it must count in the module's own state."""
    import asyncio

    import cloudpickle

    from fastapi import HTTPException

    from service import app
    from service.auth import Principal, Tokens
    from service.http_limits import HttpLimits
    from service.jobs import JobManager
    from service.settings import ServiceSettings
    from service.store import Record

    release = None

    class Ray:
        async def tail_job_logs(self, sid):
            yield "a line\n"
            await release.wait()

        def get_job_status(self, sid):
            raise ConnectionError("not here")

    settings = ServiceSettings(storage_root=str(tmp_path / "root"), state_dir=str(tmp_path / "state"),
                               ray_dashboard_url="http://127.0.0.1:1", reconcile_interval_s=3600)
    record = Record(id="j-000000000001", kind="job", tenant="a", name="n", spec={}, spec_uri="x", storage="y",
                    created_at=0.0, updated_at=0.0, submissions=["etrain-j-000000000001-0"])
    JobManager(settings, Ray()).store.save(record)
    stop = app.configure(settings, Tokens([]), client=Ray(), http=HttpLimits(follow_streams_per_tenant=2))
    logs = next(r.endpoint for r in app.app.routes if getattr(r, "path", "") == "/v1/jobs/{record_id}/logs")
    if pickled:
        logs = cloudpickle.loads(cloudpickle.dumps(logs))

    async def scenario():
        nonlocal release
        release = asyncio.Event()
        alice, alices_other_token = Principal("a", "user"), Principal("a", "admin")

        async def follow(who):
            answer = await logs(record_id=record.id, tail=10, follow=True, who=who)
            body = answer.body_iterator
            assert await body.__anext__() == "a line\n"
            return body
        held = [await follow(alice), await follow(alice)]
        with pytest.raises(HTTPException) as refused:
            await follow(alice)
        assert refused.value.status_code == 429
        assert refused.value.detail == ("tenant 'a' follows 2 logs at once, the most it may (2): stop following one, "
                                        "or read the tail without follow")
        await held[0].aclose()  # a client that goes away frees its slot
        held[0] = await follow(alices_other_token)  # counted per tenant, whatever the token
        release.set()
        for body in held:
            with pytest.raises(StopAsyncIteration):
                await body.__anext__()
        assert app._state["following"]["a"] == 0
    try:
        asyncio.run(scenario())
    finally:
        stop.set()
