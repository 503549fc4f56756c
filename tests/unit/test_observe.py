"""Metrics maths, dashboards as code (pushed to a recording HTTP server), and the page's charts."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cluster.dashboards import build_dashboards, panel_queries, push, write_provisioning
from cluster.metrics import NodeKind, cost_usd, goodput, node_kind, scrape_config
from service.web import job_data, job_page, jobs_page
from trainers.observe import group_kinds

PRICES = {"g5.2xlarge": {"on_demand": 1.2, "spot": 0.5}}


@pytest.mark.parametrize("resources,kind", [
    ({"CPU": 8, "spot": 1, "instance_g5.2xlarge": 1}, NodeKind("g5.2xlarge", "spot")),
    ({"CPU": 8, "ondemand": 1, "instance_g5.2xlarge": 1}, NodeKind("g5.2xlarge", "on_demand")),
    ({"CPU": 2}, NodeKind("local", "on_demand")),
])
def test_node_kind_from_resources(resources, kind):
    assert node_kind(resources) == kind


@pytest.mark.parametrize("kind,hours,expected", [
    (NodeKind("g5.2xlarge", "spot"), 2.0, (1.0, 1.4)),
    (NodeKind("g5.2xlarge", "on_demand"), 2.0, (2.4, 0.0)),
    (NodeKind("unknown", "spot"), 5.0, (0.0, 0.0)),
])
def test_cost_and_savings(kind, hours, expected):
    assert cost_usd(hours, kind, PRICES) == pytest.approx(expected)


@pytest.mark.parametrize("productive,wall,expected", [(50, 100, 0.5), (0, 10, 0.0), (10, 0, 0.0), (120, 100, 1.0)])
def test_goodput(productive, wall, expected):
    assert goodput(productive, wall) == expected


def test_a_node_counts_once_in_the_group():
    spot, od = NodeKind("g5", "spot"), NodeKind("g5", "on_demand")
    assert group_kinds([("n1", spot), ("n1", spot), ("n2", spot), ("n3", od)]) == {spot: 2, od: 1}


def test_scrape_config_honours_our_job_label():
    cfg = json.loads(scrape_config(["127.0.0.1:8080"], "/tmp/ray/prom_metrics_service_discovery.json", 5))
    job = cfg["scrape_configs"][0]
    assert job["honor_labels"] is True and job["static_configs"][0]["targets"] == ["127.0.0.1:8080"]
    assert job["file_sd_configs"][0]["files"] == ["/tmp/ray/prom_metrics_service_discovery.json"]


def test_dashboards_are_complete():
    boards = build_dashboards()
    assert [d["uid"] for d in boards] == ["etrain-overview", "etrain-job", "etrain-cost"]
    for d in boards:
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)) and all(p["targets"][0]["expr"] for p in d["panels"])
        assert {link["url"] for link in d["links"]} == {"/d/rayDefaultDashboard", "/d/rayTrainDashboard",
                                                         "/d/rayServeDashboard"}  # Ray's own: linked, not copied
    job = boards[1]
    assert [v["name"] for v in job["templating"]["list"]] == ["datasource", "job"]
    assert all("$job" in expr for uid, _, expr in panel_queries([job]))
    gpu = [t for _, t, _ in panel_queries(build_dashboards(gpu=True))]
    assert "GPU utilisation by rank" in gpu and "GPU utilisation by rank" not in [t for _, t, _ in panel_queries(boards)]


class Recorder(BaseHTTPRequestHandler):
    calls: list = []

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        call = {"method": self.command, "path": self.path, "auth": self.headers.get("Authorization"), "body": body}
        Recorder.calls.append(call)
        return call

    def do_GET(self):
        self._record()
        self._reply(404, {"message": "Folder not found"})

    def do_POST(self):
        call = self._record()
        if self.path == "/api/folders":
            self._reply(200, {"uid": call["body"]["uid"], "title": call["body"]["title"]})
        else:
            uid = call["body"]["dashboard"]["uid"]
            self._reply(200, {"status": "success", "uid": uid, "url": f"/d/{uid}/x"})

    def log_message(self, *args):
        pass


def test_push_creates_the_folder_and_every_dashboard():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    Recorder.calls.clear()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        urls = push(url, "glsa_token", build_dashboards())
    finally:
        server.shutdown()
        server.server_close()
    assert urls == [f"{url}/d/etrain-overview/x", f"{url}/d/etrain-job/x", f"{url}/d/etrain-cost/x"]
    paths = [(c["method"], c["path"]) for c in Recorder.calls]
    assert paths == [("GET", "/api/folders/elastic-train"), ("POST", "/api/folders")] + [("POST", "/api/dashboards/db")] * 3
    assert all(c["auth"] == "Bearer glsa_token" for c in Recorder.calls)
    posted = [c["body"] for c in Recorder.calls[2:]]
    assert all(b["overwrite"] and b["folderUid"] == "elastic-train" for b in posted)


def test_the_cli_refuses_a_push_without_a_token(capsys, monkeypatch):
    from service.cli import main

    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    assert main(["dashboards", "push", "--url", "http://127.0.0.1:9"]) == 2
    assert "--token (or GRAFANA_TOKEN)" in capsys.readouterr().err


def test_file_provisioning(tmp_path):
    written = write_provisioning(tmp_path, build_dashboards())
    assert "type: file" in written[0].read_text() and str(tmp_path / "dashboards") in written[0].read_text()
    assert json.loads((tmp_path / "dashboards" / "etrain-job.json").read_text())["uid"] == "etrain-job"


def test_the_page_carries_chart_series_by_step_and_interruption_marks():
    rows = [{"time": 100.0 + i, "step": 10 * i, "target_step": 100, "loss": 1 / (i + 1), "samples_per_s": 50.0,
             "world_size": 2, "goodput": 0.9, "cost_usd": 0.01} for i in range(1, 6)]
    interruption = {"cause": "node lost", "interrupted_at": 102.5, "step_reached": 30, "steps_lost": 3,
                    "recovery_s": 9.0, "world_size_before": 2, "world_size_after": 1}
    record = {"id": "j-1", "name": "n<script>", "state": "RUNNING"}
    page = job_page(record, rows, [interruption], [{"step": 40, "complete": True, "size_bytes": 10, "uri": "j-1/c"}],
                    "line <1>\n")
    assert "n&lt;script&gt;" in page and "<script>" not in page  # names and logs are escaped
    assert 'id="progress" class="bar big" value="50" max="100"' in page and "goodput" in page and "90%" in page
    assert 'id="loss-chart"' in page and 'id="world-chart"' in page and "line &lt;1&gt;" in page
    data = job_data(record, rows, [interruption], [], "")
    assert data["chart"]["series"]["step"] == [10, 20, 30, 40, 50]
    assert data["chart"]["series"]["world_size"] == [2] * 5 and data["chart"]["series"]["tokens_per_s"] == [None] * 5
    (mark,) = data["chart"]["interruptions"]
    assert mark["step"] == 30 and mark["label"] == "node lost at step 30: 3 steps lost, world size 2 \u2192 1"
    assert set(data["html"]) == {"summary", "interruptions", "checkpoints", "log"}
    assert 'class="interruption-row"' in data["html"]["interruptions"]
    assert "No jobs yet" in jobs_page("t", [])


def test_tensorboard_uploads_only_the_events_since_the_last_flush(tmp_path):
    """A flush at every checkpoint must not copy the run's whole event file again each time."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from cluster.storage import open_root
    from trainers.config.loading import validate
    from trainers.observe import TensorBoard

    spec = validate({"name": "tb", "training": {"max_steps": 30}})
    stored = tmp_path / "storage" / "tb" / "tensorboard"
    tb = TensorBoard(open_root(str(tmp_path / "storage")), spec, "tb", str(tmp_path / "local"))
    tb.scalars({"step": 10, "loss": 1.0})
    tb.upload()
    first = {p.name: p.read_bytes() for p in stored.rglob("events.out.tfevents.*")}
    tb.scalars({"step": 20, "loss": 0.5})
    tb.upload()
    after = {p.name: p.read_bytes() for p in stored.rglob("events.out.tfevents.*")}
    assert first and all(after[name] == data for name, data in first.items()), "an uploaded file was rewritten"
    assert len(after) == len(first) + 1
    local = [p.name for p in (tmp_path / "local").rglob("events.out.tfevents.*")]
    assert len(local) == 1 and local[0] not in after, local  # uploaded files leave rank 0's disk
    tb.close()
    acc = EventAccumulator(str(stored))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(10, 1.0), (20, 0.5)]
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")


def test_tensorboard_keeps_every_scalar_while_a_flush_runs_beside_it(tmp_path):
    """The checkpoint thread flushes (closes the event file, starts the next) while the training
    thread logs: no scalar may go to a closed writer and be lost."""
    import threading

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from cluster.storage import open_root
    from trainers.config.loading import validate
    from trainers.observe import TensorBoard

    spec = validate({"name": "tb", "training": {"max_steps": 30}})
    tb = TensorBoard(open_root(str(tmp_path / "storage")), spec, "tb", str(tmp_path / "local"))
    done = threading.Event()

    def flushes() -> None:
        while not done.is_set():
            tb.upload()

    flusher = threading.Thread(target=flushes)
    flusher.start()
    try:
        for step in range(1, 401):
            tb.scalars({"step": step, "loss": 1.0 / step})
    finally:
        done.set()
        flusher.join()
    tb.upload()
    tb.close()
    acc = EventAccumulator(str(tmp_path / "storage" / "tb" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 401))


def test_tensorboard_across_attempts_stores_names_in_upload_order_and_leaves_nothing(tmp_path):
    """A restart's TensorBoard starts its counter again: its files must still sort after the last
    attempt's. A flush with nothing new uploads nothing; one that comes after close() (a failing
    attempt's checkpoint thread) leaves no writer or file behind on rank 0's disk."""
    from cluster.storage import open_root
    from trainers.config.loading import validate
    from trainers.observe import TensorBoard

    spec = validate({"name": "tb-attempts", "training": {"max_steps": 30}})
    stored = tmp_path / "storage" / "tb" / "tensorboard"
    order = []
    for attempt in range(2):
        local = tmp_path / f"local-{attempt}"
        tb = TensorBoard(open_root(str(tmp_path / "storage")), spec, "tb", str(local))
        for step in (10, 20):
            tb.scalars({"step": step, "loss": 1.0})
            tb.upload()
            order += sorted({p.name for p in stored.iterdir()} - set(order))
        count = len(list(stored.iterdir()))
        tb.upload()  # nothing new since the last
        assert len(list(stored.iterdir())) == count
        assert any("tb-attempts" in p.name for p in local.iterdir()), "a local file names its job"
        tb.close()
        tb.upload()
        tb.scalars({"step": 30, "loss": 1.0})
        assert not local.exists(), list(local.rglob("*"))
        time.sleep(0.01)
    assert sorted(order) == order, order


def test_an_attempt_that_resumes_hides_the_steps_the_one_before_logged_past_its_checkpoint(tmp_path):
    """An attempt dies at step 30 with 20 its newest checkpoint; the next trains 30 again. Event
    files of version 2 are never purged by a step going back, only by a session start at a step:
    without one TensorBoard drew step 30 twice (each attempt's value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from cluster.storage import open_root
    from trainers.config.loading import validate
    from trainers.observe import TensorBoard

    spec = validate({"name": "tb-resume", "training": {"max_steps": 40}})
    root = open_root(str(tmp_path / "storage"))
    first = TensorBoard(root, spec, "tb", str(tmp_path / "local-0"), first_step=1)
    for step in (10, 20, 30):
        first.scalars({"step": step, "loss": 1.0})
    first.upload()
    first.close()
    time.sleep(0.01)
    second = TensorBoard(root, spec, "tb", str(tmp_path / "local-1"), first_step=21)
    for step in (30, 40):
        second.scalars({"step": step, "loss": 2.0})
    second.upload()
    second.close()
    acc = EventAccumulator(str(tmp_path / "storage" / "tb" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(10, 1.0), (20, 1.0), (30, 2.0), (40, 2.0)]


@pytest.mark.parametrize("flushed_after", [False, True])
def test_history_rows_no_flush_wrote_ride_in_the_checkpoint_and_the_next_attempt_writes_them(tmp_path, flushed_after):
    """A checkpoint between reports flushes nothing: the rows logged before it go into it, and the
    attempt that restores it writes them (history and TensorBoard), so a restart leaves no gap.
    A reported checkpoint takes its rows before the state is built: it carries none twice.
    ``flushed_after``: the attempt went on and flushed those rows at a later checkpoint, which the
    restore then skipped (damaged): TensorBoard shows each step once all the same."""
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from cluster.storage import open_root
    from trainers.config.loading import validate
    from trainers.history import read_history
    from trainers.observe import Observer

    spec = validate({"name": "carry", "training": {"max_steps": 30}})
    root = open_root(str(tmp_path / "storage"))

    def observer(restored, start_step):
        return Observer(spec, root, 0, torch.device("cpu"), 0.0, restored, {}, staging=str(tmp_path / "staging"),
                        start_step=start_step)

    def log(obs, step):
        obs.log_step({"step": step, "loss": 1.0 / step, "learning_rate": 0.1, "samples_per_s": 1.0,
                      "tokens_per_s": 0.0, "world_size": 1}, 1.0)

    first = observer(None, 0)
    log(first, 10)
    first.flusher()()  # the reported checkpoint at 10
    assert first.checkpoint_state()["unflushed_rows"] == []
    log(first, 20)
    log(first, 30)
    state = first.checkpoint_state()  # the checkpoint at 30, not reported; then the attempt dies
    if flushed_after:
        log(first, 40)
        first.flush()
    first.close()
    assert [r["step"] for r in state["unflushed_rows"]] == [20, 30]

    second = observer(state, 30)
    log(second, 40)
    second.flush()
    second.close()
    assert [r["step"] for r in read_history(root, "carry")] == [10, 20, 30, 40]
    acc = EventAccumulator(str(tmp_path / "storage" / "carry" / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [10, 20, 30, 40]
