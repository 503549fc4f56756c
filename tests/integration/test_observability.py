"""Seeing a job: a real Prometheus scraping a real 2-worker run submitted through the service;
every dashboard query answers; TensorBoard files read back; a profile; the web page in Chromium."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
from conftest import free_port
from waiting import wait_for

pytestmark = pytest.mark.ray
TOKEN = "observer-token-0123456789"
PROMETHEUS = shutil.which("prometheus")
CHROMIUM = shutil.which("chromium")


def prom_query(url: str, expr: str) -> list[dict]:
    body = requests.get(f"{url}/api/v1/query", params={"query": expr}, timeout=30).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


@pytest.fixture(scope="module")
def observed(ray_local, tmp_path_factory):
    """Prometheus + the service + one 2-worker job (submitted over HTTP), running while the tests look."""
    if not PROMETHEUS:
        pytest.fail("prometheus is not installed: `make test` installs it (bash tests/system_packages.sh)")
    from ray import serve
    from ray._private.worker import get_dashboard_url

    from cluster.cli import prometheus_config_text
    from service.auth import TokenEntry
    from service.deployment import JobService
    from service.jobs import ServiceSettings

    work = tmp_path_factory.mktemp("observed")
    (work / "prometheus.yml").write_text(prometheus_config_text(interval_s=1))
    prom_port = free_port()
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={work / 'prometheus.yml'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}", f"--storage.tsdb.path={work / 'tsdb'}"],
                            stdout=open(work / "prometheus.log", "w"), stderr=subprocess.STDOUT)
    port = free_port()
    settings = ServiceSettings(storage_root=str(work / "root"), state_dir=str(work / "state"),
                               ray_dashboard_url=f"http://{get_dashboard_url()}", reconcile_interval_s=1, stop_wait_s=60,
                               allowed_factories=["slowpkg:busy_model", "userpkg:make_data"])
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(JobService.bind(settings.model_dump(), [TokenEntry(tenant="team-o", role="user", token=TOKEN)
                                                          .model_dump(exclude={"token"})]), name="etrain", route_prefix="/")
        url, headers = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {TOKEN}"}
        spec = {"name": "observed", "training": {"batch_size": 64, "max_steps": 200000, "log_interval_steps": 10,
                                                 "profile": {"start_step": 20, "num_steps": 5}},
                # 10 ms a step (a step's compute, without the CPU): it runs until the module ends
                "distributed": {"num_workers": 2},
                "model": {"factory": "slowpkg:busy_model", "options": {"compute_s": 0.01}},
                "data": {"factory": "userpkg:make_data"},
                "checkpoint": {"interval": 50, "min_interval_s": 2},
                "cost": {"prices_per_hour": {"local": {"on_demand": 3.0, "spot": 1.0}}}}
        started = time.time()
        job = requests.post(f"{url}/v1/jobs", json=spec, headers=headers, timeout=60).json()
        yield SimpleNamespace(url=url, headers=headers, job=job["id"], prom=f"http://127.0.0.1:{prom_port}",
                              root=work / "root" / "tenants" / "team-o", started=started, work=work)
        requests.post(f"{url}/v1/jobs/{job['id']}/stop", headers=headers, timeout=60)
        wait_for(lambda: requests.get(f"{url}/v1/jobs/{job['id']}", headers=headers, timeout=30).json()["state"]
                 in ("STOPPED", "FAILED"), 180, "the observed job to stop")
    finally:
        prom.terminate()
        prom.wait(30)
        serve.shutdown()


def test_prometheus_has_the_jobs_series_with_labels(observed):
    job = observed.job
    ranks = wait_for(lambda: {s["metric"]["rank"] for s in prom_query(observed.prom, f'ray_etrain_loss{{job="{job}"}}')}
                     >= {"0", "1"} and prom_query(observed.prom, f'ray_etrain_loss{{job="{job}"}}'), 180,
                     "both ranks' loss in Prometheus")
    assert {s["metric"]["tenant"] for s in ranks} == {"team-o"}
    for name in ("samples_per_s", "step_time_s", "data_wait_fraction", "world_size", "learning_rate"):
        assert prom_query(observed.prom, f'ray_etrain_{name}{{job="{job}", rank="0"}}'), name
    goodput = wait_for(lambda: prom_query(observed.prom, f'ray_etrain_goodput{{job="{job}"}}'), 60, "goodput")
    assert 0 < float(goodput[0]["value"][1]) <= 1
    cost = wait_for(lambda: prom_query(observed.prom, f'ray_etrain_cost_usd{{job="{job}"}}'), 60, "cost")
    assert cost[0]["metric"]["market"] == "on_demand" and cost[0]["metric"]["instance_type"] == "local"
    assert prom_query(observed.prom, f'ray_etrain_savings_usd{{job="{job}"}}')
    wait_for(lambda: prom_query(observed.prom, "ray_etrain_request_seconds_bucket"), 60, "service latency")
    wait_for(lambda: prom_query(observed.prom, 'ray_etrain_records{kind="job", state="RUNNING"}'), 60, "records")


def test_every_dashboard_panel_has_data_for_the_run(observed):
    from cluster.dashboards import build_dashboards, panel_queries

    for name in ("checkpoint_save_s", "checkpoint_upload_s"):
        wait_for(lambda: prom_query(observed.prom, f'ray_etrain_{name}{{job="{observed.job}", rank="0"}}'), 180,
                 f"{name} of a checkpoint")
    dead = []  # the job is still running: each panel's query answers now, as Grafana's latest point would
    for uid, title, expr in panel_queries(build_dashboards()):
        if not prom_query(observed.prom, expr.replace("$job", observed.job)):
            dead.append(f"{uid}: {title}: {expr}")
    assert not dead, "panels without data:\n" + "\n".join(dead)


def test_tensorboard_event_files_read_back(observed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = observed.root / observed.job / "tensorboard"
    wait_for(lambda: list(tb.glob("events.out.tfevents.*")), 120, "event files in storage")
    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/samples_per_s", "train/learning_rate", "train/data_wait_fraction",
            "train/goodput"} <= tags, tags
    assert [e.step for e in acc.Scalars("train/loss")][:2] == [10, 20]
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")  # the run's hyperparameters


def test_the_profile_is_listed_and_loads_as_json(observed):
    uris = wait_for(lambda: requests.get(f"{observed.url}/v1/jobs/{observed.job}/profiles", headers=observed.headers,
                                         timeout=30).json(), 120, "a profile")
    assert uris[0].startswith(f"{observed.job}/") and uris[0].endswith("trace-steps-20-25.json")  # storage-relative
    trace = json.loads((observed.root / uris[0]).read_text())
    assert trace["traceEvents"], "empty trace"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_the_web_page_shows_jobs_and_curves_in_chromium(observed, tmp_path):
    from browser import Browser

    if not CHROMIUM:
        pytest.fail("chromium is not installed: `make test` installs it (bash tests/system_packages.sh)")
    wait_for(lambda: len(requests.get(f"{observed.url}/v1/jobs/{observed.job}/metrics", headers=observed.headers,
                                      timeout=30).json()["rows"]) >= 3, 120, "a few metric rows")
    browser = Browser(tmp_path / "profile")
    try:
        browser.sign_in(observed.url, TOKEN)  # the form: a token never goes in a URL
        assert observed.job in browser.eval("document.body.innerText") and "RUNNING" in browser.eval(
            "document.body.innerText")
        browser.goto(f"{observed.url}/ui/jobs/{observed.job}")
        wait_for(lambda: browser.eval("document.querySelectorAll('#charts canvas').length") == 5, 30,
                 "the page's script to draw five charts")
        dom = browser.eval("document.documentElement.outerHTML")
        assert 'id="loss-chart"' in dom and 'id="throughput-chart"' in dom, dom[:2000]
        assert 'id="checkpoints"' in dom and 'id="log"' in dom
        # The stylesheet loaded under the page's CSP (style-src 'self'): the chart has its border.
        assert browser.eval("getComputedStyle(document.querySelector('figure.chart')).borderTopStyle") == "solid"
        shot = tmp_path / "job.png"
        browser.screenshot(shot)
        viewport = tuple(browser.eval("[window.innerWidth, window.innerHeight]"))
    finally:
        browser.close()
    # The window is 1280 wide; headless Chromium's viewport height is the window's less its hidden frame.
    assert png_size(shot) == viewport and viewport[0] == 1280 and shot.stat().st_size > 20_000  # not a blank page
    assert requests.get(f"{observed.url}/ui/jobs/{observed.job}", timeout=30).status_code == 401  # no cookie: sign in
