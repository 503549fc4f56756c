"""The job page as a person sees it, in headless Chromium: a real job through the service, with
one interruption (a user bug the retry outlives), watched while it runs and after it ends.
The retried run waits at its first step until the test has looked at the running page
(tests/fixtures/pagepkg.py), then runs to its end at full speed.

Screenshots (the jobs list, the job page during and after the run) are kept under
``artifacts/screenshots/`` in the repository (or $ETRAIN_ARTIFACTS_DIR); the test prints where.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from conftest import free_port
from waiting import wait_for

pytestmark = pytest.mark.ray
TOKEN = "page-viewer-0123456789abcdef"
REPO = Path(__file__).resolve().parents[2]
CODE_PATH = f"{REPO}:{REPO / 'tests' / 'fixtures'}"
TARGET = 80  # fails at 40, waits at 50 while the page is watched, then 30 steps at full speed
ARTIFACTS = Path(os.environ.get("ETRAIN_ARTIFACTS_DIR") or REPO / "artifacts") / "screenshots"


@pytest.fixture(scope="module")
def watched(ray_local, tmp_path_factory):
    """The service, and a job that fails once at step 40, resumes from its checkpoint and waits there
    while ``hold`` exists."""
    from ray import serve
    from ray._private.worker import get_dashboard_url

    from service.deployment import JobService
    from service.auth import TokenEntry
    from service.settings import ServiceSettings

    if not shutil.which("chromium"):
        pytest.fail("chromium is not installed: `make test` installs it (bash tests/system_packages.sh)")
    wait_for_jobs_agent(f"http://{get_dashboard_url()}")
    work = tmp_path_factory.mktemp("page")
    settings = ServiceSettings(storage_root=str(work / "root"), state_dir=str(work / "state"),
                               ray_dashboard_url=f"http://{get_dashboard_url()}", reconcile_interval_s=1,
                               stop_wait_s=30, allowed_factories=["pagepkg:held_after_failure", "userpkg:make_data"],
                               tenant_env={"team-p": {"PYTHONPATH": CODE_PATH}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(JobService.bind(settings.model_dump(), [TokenEntry(tenant="team-p", role="user", token=TOKEN)
                                                      .model_dump(exclude={"token"})]), name="etrain", route_prefix="/")
    url, headers = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {TOKEN}"}
    hold = work / "hold"
    hold.touch()
    spec = {"name": "watched", "training": {"batch_size": 30, "learning_rate": 0.05, "max_steps": TARGET,
                                            "log_interval_steps": 5},
            "distributed": {"num_workers": 1}, "checkpoint": {"interval": 10, "min_interval_s": 0},
            "fault_tolerance": {"max_failures": 1},
            "model": {"factory": "pagepkg:held_after_failure",
                      "options": {"marker": str(work / "failed-once"), "fail_at": 40, "hold": str(hold)}},
            "data": {"factory": "userpkg:make_data"}}
    job = requests.post(f"{url}/v1/jobs", json=spec, headers=headers, timeout=60).json()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    print(f"\n[test] screenshots of the page go to {ARTIFACTS}")
    try:
        yield SimpleNamespace(url=url, headers=headers, job=job["id"], work=work, hold=hold,
                              folder=work / "root" / "tenants" / "team-p" / job["id"])
    finally:
        hold.unlink(missing_ok=True)  # a test that failed before letting the run go leaves no job waiting in Ray
        serve.delete("etrain")
        serve.shutdown()


def wait_for_jobs_agent(dashboard_url: str) -> None:
    """Ray's Jobs API refuses submissions ("No available agent to submit job, please try again
    later") until a node's agent has registered, which on a busy machine takes a while after
    Ray starts: a throwaway submission tells when it is there."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(dashboard_url)

    def accepted() -> bool:
        try:
            client.submit_job(entrypoint="true")
        except RuntimeError as exc:
            if "No available agent" in str(exc):
                return False
            raise
        return True
    wait_for(accepted, 180, "Ray's Jobs API to accept a submission (its node agent listens on port 52365: "
                            "another Ray on this machine may hold it)", poll_s=2)


def state_of(watched) -> str:
    return requests.get(f"{watched.url}/v1/jobs/{watched.job}", headers=watched.headers, timeout=30).json()["state"]


def look(browser) -> dict:
    """What a person would look for on the job page, read from the DOM and the page's charts."""
    chart = "window.etrainCharts['loss-chart']"
    return browser.eval(f"""(() => {{
        const p = document.getElementById('progress');
        const marks = [...document.querySelectorAll('#loss-chart .interruption-marker')];
        return {{state: document.querySelector('.summary .badge').textContent, value: p.value, max: p.max,
                 axis: {chart} ? {chart}.axes[0].label : null, steps: {chart} ? [...{chart}.data[0]] : [],
                 marks: marks.map(m => m.title), markedCharts: document.querySelectorAll('.interruption-marker').length,
                 log: document.getElementById('log').textContent, html: document.documentElement.outerHTML,
                 sameLoad: window.__sameLoad === 'during'}};
    }})()""")


def test_the_job_page_during_and_after_a_run_with_an_interruption(watched, tmp_path):
    from browser import Browser

    interruptions = watched.folder / "interruptions.json"

    def recorded():
        if state_of(watched) not in ("PENDING", "RUNNING"):
            log = requests.get(f"{watched.url}/v1/jobs/{watched.job}/logs", headers=watched.headers, timeout=30).text
            raise AssertionError(f"the job ended before its interruption was seen:\n{log[-3000:]}")
        return interruptions.exists() and json.loads(interruptions.read_text())
    wait_for(recorded, 600, "the interruption to be recorded", poll_s=1)
    browser = Browser(tmp_path / "profile")
    try:
        browser.sign_in(watched.url, TOKEN)
        # The jobs list, filtered by state.
        browser.goto(f"{watched.url}/?state=RUNNING")
        jobs = browser.eval("document.getElementById('jobs').innerText")
        assert "watched" in jobs and watched.job in jobs and "RUNNING" in jobs, jobs
        assert browser.eval("document.querySelector('#jobs progress').max") == TARGET
        browser.screenshot(ARTIFACTS / "jobs-list.png")
        browser.goto(f"{watched.url}/?state=FAILED")
        assert watched.job not in browser.eval("document.body.innerText")

        # The job page while it runs.
        browser.goto(f"{watched.url}/ui/jobs/{watched.job}")
        browser.eval("window.__sameLoad = 'during'")  # gone if the page ever reloads
        during = wait_for(lambda: (lambda s: s if s["steps"] and s["marks"] else None)(look(browser)),
                          60, "the curves with their interruption marker")
        assert during["state"] == "RUNNING", f"the held run shows {during['state']} on the page, not RUNNING"
        assert 0 < during["value"] < during["max"] == TARGET
        assert during["axis"] == "step" and during["steps"] == sorted(during["steps"]) and during["steps"][0] == 5
        (mark,) = during["marks"]
        assert re.fullmatch(r"user error at step \d+: \d+ steps lost, world size 1 \u2192 1", mark), mark
        assert during["markedCharts"] == 5  # every curve carries it
        hover = browser.eval("""(() => { const r = document.querySelector('#loss-chart .u-over').getBoundingClientRect();
            return [r.left + r.width * 0.5, r.top + r.height * 0.5]; })()""")
        browser.hover(*hover)
        legend = browser.eval("[...document.querySelectorAll('#loss-chart .u-legend .u-value')].map(v => v.textContent)")
        assert re.fullmatch(r"\d+", legend[0]) and re.fullmatch(r"[\d.]+(e-?\d+)?", legend[1]), legend  # step, loss
        browser.screenshot(ARTIFACTS / "job-during.png", full_page=True)
        watched.hold.unlink()  # let the run go on
        progressed = wait_for(lambda: (lambda s: s if s["value"] > during["value"] else None)(look(browser)),
                              60, "the progress to move without a reload")
        assert progressed["sameLoad"], "the page reloaded to refresh"

        # After the run: the page refreshed itself to the end.
        after = wait_for(lambda: (lambda s: s if s["state"] == "SUCCEEDED" else None)(look(browser)),
                         240, "the page to show the run succeeded")
        assert state_of(watched) == "SUCCEEDED" and after["sameLoad"]
        assert after["value"] == after["max"] == TARGET and after["steps"][-1] == TARGET
        assert len(after["marks"]) == 1
        # The log: escape codes gone, our lines there, Ray's hidden until asked for.
        for text in (after["log"], after["html"]):
            assert "\x1b" not in text and "[36m" not in text and "[0m" not in text
        assert f"[etrain] step {TARGET}/{TARGET}" in after["log"] and "recovered from user error" in after["log"]
        visible = browser.eval("document.getElementById('log').innerText")
        assert "[etrain] step" in visible and "TrainingReport(" not in visible
        browser.eval("const s = document.getElementById('log-source'); s.value = 'all';"
                     "s.dispatchEvent(new Event('change'))")
        assert "TrainingReport(" in browser.eval("document.getElementById('log').innerText")
        # No server path anywhere: checkpoints and the log say where things are in the tenant's storage.
        assert str(watched.work) not in after["html"] and "/tenants/" not in after["html"]
        checkpoints = browser.eval("[...document.querySelectorAll('#checkpoints tr.checkpoint td')].map(c => c.textContent)")
        assert checkpoints[0] == str(TARGET) and checkpoints[3].startswith(f"{watched.job}/"), checkpoints
        browser.eval("document.getElementById('log-source').value = 'default';"
                     "document.getElementById('log-source').dispatchEvent(new Event('change'))")
        browser.screenshot(ARTIFACTS / "job-after.png", full_page=True)
        browser.goto(f"{watched.url}/")
        browser.screenshot(ARTIFACTS / "jobs-list-after.png")
    finally:
        browser.close()
    for name in ("jobs-list.png", "job-during.png", "job-after.png"):
        assert (ARTIFACTS / name).stat().st_size > 20_000, name  # a rendered page, not a blank one


def test_the_pages_data_needs_the_cookie_and_names_no_other_job(watched):
    data = f"{watched.url}/ui/jobs/{watched.job}/data"
    assert requests.get(data, timeout=30).status_code == 401
    assert requests.get(data, headers=watched.headers, timeout=30).status_code == 401  # the page's own sign-in only
    cookie = {"etrain_token": TOKEN}
    answer = requests.get(data, cookies=cookie, timeout=30)
    assert answer.status_code == 200 and answer.headers["Content-Security-Policy"].startswith("default-src 'none'")
    assert set(answer.json()) == {"id", "state", "active", "chart", "html"}
    for other in ("j-000000000000", "..%2F..%2Fetc", "<b>"):
        missing = requests.get(f"{watched.url}/ui/jobs/{other}/data", cookies=cookie, timeout=30)
        assert missing.status_code == 404 and missing.headers["content-type"] == "application/json"
    assert requests.get(f"{watched.url}/ui/jobs-table", timeout=30).status_code == 401
    assert requests.get(f"{watched.url}/ui/static/etrain.js", timeout=30).headers["content-type"].startswith(
        "text/javascript")
    assert requests.get(f"{watched.url}/ui/static/..%2Fweb.py", timeout=30).status_code == 404
