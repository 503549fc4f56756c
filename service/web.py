"""The service's own web page: a tenant's jobs, and one job's progress, curves, interruptions,
checkpoints and log, refreshed in place while the job runs.

Every value goes through Jinja2 templates with autoescape on (job files, ids and logs are a
tenant's text). The page's one script and its charting library (uPlot, vendored under
service/static with its licence) come from the service itself: the Content-Security-Policy
allows script from 'self' only, never inline script, and nothing from the internet. The
script fetches ``/ui/jobs/<id>/data`` (JSON: chart series, and the page's parts rendered
here by the same escaping templates) and never builds HTML from a job's text itself. The
only way in is the sign-in form, which sets an HttpOnly, Secure, SameSite=Strict cookie: a
token never appears in a URL.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined

from service.front_door import downsample
from service.http_limits import HttpLimits
from service.states import ACTIVE, JobState
from trainers.api import strip_ansi

# Script and styles only from the service itself, data only from it, forms only to it, no framing.
CSP = ("default-src 'none'; script-src 'self'; connect-src 'self'; style-src 'self'; img-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cache-Control": "no-store"}
# The files under service/static the page may load, with their media types; nothing else is served.
STATIC = {"etrain.css": "text/css", "etrain.js": "text/javascript",
          "vendor/uplot/uPlot.iife.min.js": "text/javascript", "vendor/uplot/uPlot.min.css": "text/css",
          "vendor/uplot/LICENSE": "text/plain"}
# What each chart plots against the step: (history key, legend label).
CHART_SERIES = ("loss", "learning_rate", "samples_per_s", "tokens_per_s", "data_wait_fraction", "world_size")
RAY_PREFIX = re.compile(r"^\((?:[\w.:-]+ )*pid=\w+(?:, ip=[\d.:a-f]+)?\) ?")
RAY_DRIVER_LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
GLOG = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (?P<level>[DIWEF]) \d+ \d+\]")
GLOG_LEVELS = {"D": "debug", "I": "info", "W": "warning", "E": "error", "F": "error"}
ERROR_WORDS = re.compile(r"\b(ERROR|CRITICAL|FATAL)\b|^Traceback \(most recent call last\)|^\w[\w.]*(Error|Exception): ")
# Every pattern here runs on a tenant's log lines, so each must stay linear in a line's length:
# none may start a search whose scan backtracks over a run it could start in again (a bare
# ``\w+Warning`` retried the whole run of word characters from each of its starts).
WARNING_WORDS = re.compile(r"\bWARN(ING)?\b|(?<=\w)Warning: ")
EXCEPTION_END = re.compile(r"^\w[\w.]*(Error|Exception|Exit|Interrupt)\b")
HTTP_METHODS = ("get", "post", "put", "patch", "delete")
MAX_POINTS, JOBS_PAGE_ROWS = HttpLimits().max_metrics_points, HttpLimits().jobs_page_rows

_env = Environment(loader=PackageLoader("service", "templates"), autoescape=True, undefined=StrictUndefined)


def render(template: str, **context: Any) -> str:
    return _env.get_template(template).render(**context)


def static_file(name: str) -> tuple[bytes, str] | None:
    """(bytes, media type) of an allowed static file, else None."""
    if name not in STATIC:
        return None
    return resources.files("service").joinpath("static", *name.split("/")).read_bytes(), STATIC[name]


def login_page(message: str = "") -> str:
    return render("login.html", title="elastic-train: sign in", message=message)


def not_found_page(message: str) -> str:
    return render("not_found.html", title="not found", message=message)


# ---------------------------------------------------------------- numbers, as a person reads them


def number(v: Any) -> float | None:
    """``v`` when it is a finite number, else None: job files are a tenant's, not to be trusted."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return v
    return None


def fmt_time(t: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if number(t) is not None and t > 0 else "-"


def percent(v: Any) -> str:
    return "-" if number(v) is None else f"{100 * v:.0f}%"


def usd(v: Any) -> str:
    if number(v) is None:
        return "-"
    return "$0" if v == 0 else f"${v:.4f}" if v < 0.01 else f"${v:,.2f}"


def duration(seconds: Any) -> str:
    """3 s, 5 min, 2 h 10 min, 3 d 4 h: as long as it needs to be, no longer."""
    s = number(seconds)
    if s is None or s < 0:
        return "-"
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s // 60:.0f} min {s % 60:.0f} s" if s < 600 else f"{s // 60:.0f} min"
    if s < 86400:
        return f"{s // 3600:.0f} h {s % 3600 // 60:.0f} min"
    return f"{s // 86400:.0f} d {s % 86400 // 3600:.0f} h"


def metric(v: Any, digits: int = 4) -> str:
    n = number(v)
    if n is None:
        return "-"
    return f"{n:.{digits}g}" if abs(n) >= 1e-3 or n == 0 else f"{n:.2e}"


# ---------------------------------------------------------------- progress


def valid_rows(rows: Sequence[Any]) -> list[dict]:
    return [r for r in rows if isinstance(r, dict) and number(r.get("time")) is not None
            and number(r.get("step")) is not None]


def eta_s(rows: Sequence[dict], target: Any, since_step: Any = None, window: int = 10) -> float | None:
    """Seconds to ``target`` at the pace of the latest rows after ``since_step`` (where the last
    restart resumed: the time before it is no pace of training). A row older than the one after
    it (the steps were done again later) also ends the window."""
    rows, target, since = valid_rows(rows), number(target), number(since_step)
    rows = [r for r in rows if since is None or r["step"] > since]
    if not rows or target is None:
        return None
    tail = [rows[-1]]
    for r in reversed(rows[:-1]):
        if len(tail) == window or r["time"] >= tail[-1]["time"]:
            break
        tail.append(r)
    first, last = tail[-1], tail[0]
    if last["step"] >= target:
        return 0.0
    if last["step"] <= first["step"] or last["time"] <= first["time"]:
        return None
    return (target - last["step"]) * (last["time"] - first["time"]) / (last["step"] - first["step"])


def progress_of(record: dict, rows: Sequence[Any], interruptions: Sequence[Any] = ()) -> dict:
    """Where a job stands: the latest history row, else the run's summary, else the spec's target."""
    rows = valid_rows(rows)
    restored = [number(i.get("restored_step")) for i in interruptions if isinstance(i, dict)]
    since = max((r for r in restored if r is not None), default=None)
    last = rows[-1] if rows else {}
    summary = record.get("summary") if isinstance(record.get("summary"), dict) else {}
    training = (record.get("spec") or {}).get("training") or {}
    step = number(last.get("step"))
    step = number(summary.get("final_step")) if step is None else step
    target = number(last.get("target_step")) or number(summary.get("target_step")) or number(training.get("max_steps"))
    running = record.get("state") in (JobState.RUNNING, JobState.STOPPING)
    return {"step": step, "target_step": target,
            "fraction": min(1.0, step / target) if step is not None and target else None,
            "eta_s": eta_s(rows, target, since) if running else None, "loss": number(last.get("loss")),
            "samples_per_s": number(last.get("samples_per_s")), "world_size": number(last.get("world_size")),
            "goodput": number(last.get("goodput", summary.get("goodput"))),
            "cost_usd": number(last.get("cost_usd", summary.get("cost_usd"))),
            "as_of": number(last.get("time"))}


# ---------------------------------------------------------------- the log


def log_lines(text: str) -> list[dict]:
    """The log as lines a person can read and filter: ANSI codes stripped, each line's source
    (ours ``etrain``, ``ray`` for Ray's workers, actors and its own logging, else ``other``)
    and level (error, warning, info, debug). A traceback's lines are errors to its last line."""
    out, in_traceback = [], False
    for raw in text.splitlines():
        line = strip_ansi(raw).rstrip()
        m = RAY_PREFIX.match(line)
        body = line[m.end():] if m else line
        if "[etrain]" in body:
            source, body = "etrain", body[body.index("[etrain]"):]
            line = body  # our lines read the same whichever worker printed them
        elif m or RAY_DRIVER_LOG.match(body) or GLOG.match(body):
            source = "ray"
        else:
            source = "other"
        stripped = body.strip()
        if stripped.startswith("Traceback (most recent call last)"):
            in_traceback = True
        level_match = RAY_DRIVER_LOG.match(body) or GLOG.match(body)
        if in_traceback or ERROR_WORDS.search(stripped):
            level = "error"
        elif level_match:
            level = GLOG_LEVELS.get(level_match["level"], level_match["level"].lower())
            level = "warning" if level == "warning" else level
        elif WARNING_WORDS.search(body):
            level = "warning"
        else:
            level = "info"
        if in_traceback and EXCEPTION_END.match(stripped):
            in_traceback = False
        out.append({"source": source, "level": "error" if level == "critical" else level, "text": line})
    return out


# ---------------------------------------------------------------- the jobs list


def jobs_page(tenant: str, rows: Sequence[dict], state: str | None = None, now: float | None = None, page: int = 1,
              page_rows: int = JOBS_PAGE_ROWS, progress: Callable[[dict], dict] | None = None) -> str:
    """The list around one page of its table (``jobs_table``, which the page's script refreshes)."""
    return render("jobs.html", title=f"Jobs of {tenant}", state=state, page=page,
                  table=jobs_table(rows, state, now, page, page_rows, progress))


def jobs_table(rows: Sequence[dict], state: str | None = None, now: float | None = None, page: int = 1,
               page_rows: int = JOBS_PAGE_ROWS, progress: Callable[[dict], dict] | None = None) -> str:
    """rows: {id, name, kind, state, created_at, updated_at, and progress (progress_of) or ``progress``
    to read it}, newest first. Counts cover every row; only one page is shown, and only its
    rows' progress is read."""
    now = time.time() if now is None else now
    counts = {s: sum(1 for r in rows if r.get("state") == s) for s in JobState}
    matching = [r for r in rows if not state or r.get("state") == state]
    pages = max(1, math.ceil(len(matching) / page_rows))
    page = min(page, pages)
    shown = []
    for r in matching[(page - 1) * page_rows:page * page_rows]:
        p = (progress(r) if progress else r.get("progress")) or {}
        step, target = number(p.get("step")), number(p.get("target_step"))
        created = number(r.get("created_at"))
        shown.append({"id": r["id"], "name": r["name"], "kind": r["kind"], "state": r["state"],
                      "step": "-" if step is None else f"{step:.0f}", "target": "-" if not target else f"{target:.0f}",
                      "value": step if step is not None and target else None, "max": target,
                      "percent": percent(p.get("fraction")), "eta": duration(p.get("eta_s")),
                      "goodput": percent(p.get("goodput")), "cost": usd(p.get("cost_usd")),
                      "age": duration(now - created) if created is not None else "-",
                      "updated": fmt_time(r.get("updated_at"))})
    return render("jobs_table.html", rows=shown, state=state, states=list(JobState), counts=counts, total=len(rows),
                  page=page, pages=pages, state_query=f"state={state}&" if state else "")


# ---------------------------------------------------------------- one job


def chart_data(rows: Sequence[Any], interruptions: Sequence[Any]) -> dict:
    """Series by step for the charts (null where a row lacks a value), and where interruptions happened."""
    rows = valid_rows(rows)
    series = {"step": [r["step"] for r in rows]}
    for key in CHART_SERIES:
        series[key] = [number(r.get(key)) for r in rows]
    marks = []
    for i in interruptions:
        step = number(i.get("step_reached")) if isinstance(i, dict) else None
        if step is None:
            continue
        before, after = i.get("world_size_before"), i.get("world_size_after")
        marks.append({"step": step, "cause": str(i.get("cause") or "interruption"),
                      "label": f"{i.get('cause') or 'interruption'} at step {step:.0f}: "
                               f"{i.get('steps_lost', '?')} steps lost, world size {before} \u2192 {after}"})
    return {"series": series, "interruptions": marks}


def job_view(record: dict, rows: Sequence[Any], interruptions: Sequence[Any], checkpoints: Sequence[Any],
             log_text: str, max_points: int = MAX_POINTS) -> dict:
    """What the page shows, once, for both the page and its data endpoint: progress from every
    row, the charts from at most ``max_points`` of them."""
    interruptions = [i for i in interruptions if isinstance(i, dict)]
    p = progress_of(record, rows, interruptions)
    step, target = p["step"], p["target_step"]
    summary = {"state": record["state"], "step": "-" if step is None else f"{step:.0f}",
               "target": "-" if not target else f"{target:.0f}", "value": step if step is not None and target else None,
               "max": target, "percent": percent(p["fraction"]),
               "eta": duration(p["eta_s"]) if p["eta_s"] is not None else None,
               "loss": metric(p["loss"]), "rate": "-" if p["samples_per_s"] is None else f"{p['samples_per_s']:,.0f}",
               "world_size": "-" if p["world_size"] is None else f"{p['world_size']:.0f}",
               "goodput": percent(p["goodput"]), "cost": usd(p["cost_usd"]), "as_of": fmt_time(p["as_of"]),
               "interruptions": len(interruptions), "error": record.get("error")}
    shown_interruptions = [{"cause": i.get("cause"), "at": fmt_time(i.get("interrupted_at")),
                            "step": i.get("step_reached"), "steps_lost": i.get("steps_lost"),
                            "recovery": duration(i.get("recovery_s")),
                            "world": f"{i.get('world_size_before', '?')} \u2192 {i.get('world_size_after', '?')}"}
                           for i in interruptions]
    shown_checkpoints = sorted(
        ({"step": c.get("step"), "complete": c.get("complete"), "size": size(c.get("size_bytes")),
          "uri": c.get("uri"), "trial": c.get("trial")} for c in checkpoints if isinstance(c, dict)),
        key=lambda c: (number(c["step"]) is None, -(number(c["step"]) or 0)))
    lines = log_lines(log_text)
    return {"id": record["id"], "name": record["name"], "state": record["state"],
            "active": record["state"] in ACTIVE, "summary": summary, "interruptions": shown_interruptions,
            "checkpoints": shown_checkpoints, "log": lines,
            "chart": chart_data(downsample(valid_rows(rows), max_points), interruptions)}


def size(v: Any) -> str:
    n = number(v)
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"


PARTS = ("summary", "interruptions", "checkpoints", "log")


def job_page(record: dict, rows: Sequence[Any], interruptions: Sequence[Any], checkpoints: Sequence[Any],
             log_text: str, max_points: int = MAX_POINTS) -> str:
    view = job_view(record, rows, interruptions, checkpoints, log_text, max_points)
    return render("job.html", title=f"{record['name']} ({record['id']})", view=view,
                  parts={part: render("job_parts.html", part=part, view=view) for part in PARTS})


def job_data(record: dict, rows: Sequence[Any], interruptions: Sequence[Any], checkpoints: Sequence[Any],
             log_text: str, max_points: int = MAX_POINTS) -> dict:
    """The data endpoint's answer: chart series, and the page's parts as escaped HTML."""
    view = job_view(record, rows, interruptions, checkpoints, log_text, max_points)
    return {"id": view["id"], "state": view["state"], "active": view["active"], "chart": view["chart"],
            "html": {part: render("job_parts.html", part=part, view=view) for part in PARTS}}


# ---------------------------------------------------------------- the API's docs


def docs_page(openapi: dict) -> str:
    """The API's routes from its OpenAPI schema, as a page with no script at all (FastAPI's own
    docs pages load theirs from a CDN, on the service's origin)."""
    routes = []
    for path, item in sorted((openapi.get("paths") or {}).items()):
        for method in HTTP_METHODS:
            op = item.get(method)
            if isinstance(op, dict):
                routes.append({"method": method.upper(), "path": path, "summary": op.get("summary") or "",
                               "tags": ", ".join(op.get("tags") or []), "id": op.get("operationId") or ""})
    info = openapi.get("info") or {}
    return render("docs.html", title=f"{info.get('title', 'API')} {info.get('version', '')}: HTTP API",
                  description=info.get("description") or "", routes=routes)
