"""Grafana dashboards as code: jobs overview, one job, and cluster/spot/cost.

``etrain dashboards push --url URL --token TOKEN`` creates or updates them in a folder
through grafana-client; ``etrain dashboards write DIR`` writes them with a file-provisioning
config instead. Ray's own generated dashboards (default, Train, Serve) are linked from every
dashboard, not copied. Every panel's query is a PromQL expression over the ``ray_etrain_*``
series (see cluster/metrics.py); ``panel_queries`` lists them so a test can run each one.
"""

from __future__ import annotations

import json
from pathlib import Path

FOLDER_UID = "elastic-train"
FOLDER_TITLE = "elastic-train"
DS = {"type": "prometheus", "uid": "${datasource}"}
RAY_DASHBOARDS = {"Ray: default": "rayDefaultDashboard", "Ray: Train": "rayTrainDashboard",
                  "Ray: Serve": "rayServeDashboard"}


def panel(title: str, expr: str, legend: str, unit: str = "short", x: int = 0, y: int = 0, w: int = 12) -> dict:
    return {"type": "timeseries", "title": title, "datasource": DS, "gridPos": {"x": x, "y": y, "w": w, "h": 8},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": "A", "datasource": DS, "expr": expr, "legendFormat": legend}]}


def layout(panels: list[tuple]) -> list[dict]:
    """Two panels a row, in order."""
    out = []
    for i, (title, expr, legend, unit) in enumerate(panels):
        p = panel(title, expr, legend, unit, x=12 * (i % 2), y=8 * (i // 2))
        p["id"] = i + 1
        out.append(p)
    return out


def variables(job_var: bool) -> dict:
    items = [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}]
    if job_var:
        items.append({"name": "job", "type": "query", "datasource": DS, "label": "job", "refresh": 2,
                      "query": {"query": "label_values(ray_etrain_step, job)", "refId": "job"},
                      "definition": "label_values(ray_etrain_step, job)", "includeAll": False, "multi": False})
    return {"list": items}


def dashboard(uid: str, title: str, panels: list[tuple], job_var: bool = False) -> dict:
    links = [{"title": name, "type": "link", "url": f"/d/{ruid}", "targetBlank": True}
             for name, ruid in RAY_DASHBOARDS.items()]
    return {"uid": uid, "title": title, "tags": ["elastic-train"], "timezone": "browser", "schemaVersion": 39,
            "refresh": "10s", "time": {"from": "now-6h", "to": "now"}, "links": links,
            "templating": variables(job_var), "panels": layout(panels)}


def build_dashboards(gpu: bool = False) -> list[dict]:
    """The three dashboards; ``gpu`` adds the GPU utilisation and memory panels (NVML series exist on GPUs only)."""
    overview = dashboard("etrain-overview", "elastic-train: jobs overview", [
        ("Steps done", "max by (job, tenant) (ray_etrain_step)", "{{tenant}}/{{job}}", "short"),
        ("Samples per second", 'max by (job, tenant) (ray_etrain_samples_per_s{rank="0"})', "{{tenant}}/{{job}}",
         "short"),
        ("Goodput", "max by (job, tenant) (ray_etrain_goodput)", "{{tenant}}/{{job}}", "percentunit"),
        ("World size", 'max by (job) (ray_etrain_world_size{rank="0"})', "{{job}}", "short"),
        ("Service latency p95 by route", "histogram_quantile(0.95, sum by (le, route) "
         "(rate(ray_etrain_request_seconds_bucket[5m])))", "{{route}}", "s"),
        ("Jobs and sweeps by state", "sum by (kind, state) (ray_etrain_records)", "{{kind}} {{state}}", "short"),
    ])
    job = '{job="$job"}'
    job_rank0 = '{job="$job", rank="0"}'
    one_job = [
        ("Loss", f"ray_etrain_loss{job_rank0}", "loss", "short"),
        ("Learning rate", f"ray_etrain_learning_rate{job_rank0}", "lr", "short"),
        ("Throughput", f"ray_etrain_samples_per_s{job_rank0}", "samples/s", "short"),
        ("Step time by rank", f"ray_etrain_step_time_s{job}", "rank {{{{rank}}}}", "s"),
        ("Data-wait fraction by rank (GPU starving)", f"ray_etrain_data_wait_fraction{job}", "rank {{{{rank}}}}",
         "percentunit"),
        ("Checkpoint save seconds", f"ray_etrain_checkpoint_save_s{job_rank0}", "save", "s"),
        ("Checkpoint report seconds (upload wait)", f"ray_etrain_checkpoint_upload_s{job_rank0}", "report", "s"),
        ("World size", f"ray_etrain_world_size{job_rank0}", "workers", "short"),
        ("Interruptions", f"ray_etrain_interruptions{job_rank0}", "interruptions", "short"),
        ("Steps lost", f"ray_etrain_steps_lost{job_rank0}", "steps", "short"),
        ("Recovery seconds (last interruption)", f"ray_etrain_recovery_s{job_rank0}", "seconds", "s"),
        ("Goodput", f"ray_etrain_goodput{job_rank0}", "goodput", "percentunit"),
    ]
    if gpu:
        one_job += [("GPU utilisation by rank", f"ray_etrain_gpu_utilization{job}", "rank {{{{rank}}}}", "percentunit"),
                    ("GPU memory by rank", f"ray_etrain_gpu_memory_bytes{job}", "rank {{{{rank}}}}", "bytes")]
    cost = dashboard("etrain-cost", "elastic-train: cluster, spot and cost", [
        ("Node-hours by instance type and market", "sum by (instance_type, market) (ray_etrain_node_hours)",
         "{{instance_type}} {{market}}", "short"),
        ("Cost (USD) by job", "sum by (job, tenant) (ray_etrain_cost_usd)", "{{tenant}}/{{job}}", "currencyUSD"),
        ("Saved against on-demand (USD)", "sum by (job, tenant) (ray_etrain_savings_usd)", "{{tenant}}/{{job}}",
         "currencyUSD"),
        ("Interruptions by job", 'max by (job) (ray_etrain_interruptions{rank="0"})', "{{job}}", "short"),
        ("Workers in training", 'sum(ray_etrain_world_size{rank="0"})', "workers", "short"),
        ("Steps lost by job", 'max by (job) (ray_etrain_steps_lost{rank="0"})', "{{job}}", "short"),
    ])
    return [overview, dashboard("etrain-job", "elastic-train: job", one_job, job_var=True), cost]


def panel_queries(dashboards: list[dict]) -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, expression) for every query of every panel."""
    return [(d["uid"], p["title"], t["expr"]) for d in dashboards for p in d["panels"] for t in p["targets"]]


def push(url: str, token: str, dashboards: list[dict], folder_uid: str = FOLDER_UID) -> list[str]:
    """Create the folder if needed and create-or-update each dashboard; returns their URLs."""
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaClientError

    api = GrafanaApi.from_url(url, credential=token)
    try:
        api.folder.get_folder(folder_uid)
    except GrafanaClientError as exc:
        if exc.status_code != 404:
            raise
        api.folder.create_folder(FOLDER_TITLE, uid=folder_uid)
    urls = []
    for d in dashboards:
        out = api.dashboard.update_dashboard({"dashboard": d, "folderUid": folder_uid, "overwrite": True,
                                              "message": "elastic-train dashboards as code"})
        urls.append(url.rstrip("/") + out.get("url", f"/d/{d['uid']}"))
    return urls


def write_provisioning(directory: str | Path, dashboards: list[dict]) -> list[Path]:
    """Dashboards as JSON files plus the provider file Grafana reads at start (file provisioning)."""
    directory = Path(directory)
    (directory / "dashboards").mkdir(parents=True, exist_ok=True)
    written = []
    for d in dashboards:
        path = directory / "dashboards" / f"{d['uid']}.json"
        path.write_text(json.dumps(d, indent=2))
        written.append(path)
    provider = directory / "etrain-dashboards.yaml"
    provider.write_text(
        "apiVersion: 1\nproviders:\n  - name: elastic-train\n    folder: elastic-train\n    type: file\n"
        f"    allowUiUpdates: false\n    options:\n      path: {(directory / 'dashboards').resolve()}\n")
    return [provider, *written]
