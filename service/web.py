"""The service's own web page: a tenant's jobs, and one job's curves, interruptions, checkpoints
and log tail. Server-rendered HTML with inline SVG charts: no script, nothing from the internet.

Every value goes through Jinja2 templates with autoescape on (job files, ids and logs are a
tenant's text), every page carries a Content-Security-Policy that allows no script at all,
and the only way in is the sign-in form, which sets an HttpOnly, Secure, SameSite=Strict
cookie: a token never appears in a URL.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined

STYLE = """
body{font:14px system-ui,sans-serif;margin:24px;color:#1b1f24}
table{border-collapse:collapse}td,th{padding:4px 10px;border-bottom:1px solid #ddd;text-align:left}
.state-RUNNING{color:#0a7}.state-FAILED{color:#c22}.state-SUCCEEDED{color:#25a}.state-STOPPED{color:#a70}
.error{color:#c22}
svg.chart{background:#fafbfc;border:1px solid #ddd;margin:8px 16px 8px 0}
svg .line{fill:none;stroke:#25a;stroke-width:1.5}svg .interruption{stroke:#c22;stroke-dasharray:4 3}
svg text{font-size:11px;fill:#555}pre{background:#f5f5f5;padding:8px;max-height:360px;overflow:auto}
"""
# No script from anywhere, styles only from our own stylesheet, forms only to ourselves, no framing.
CSP = ("default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; "
       "base-uri 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cache-Control": "no-store"}

_env = Environment(loader=PackageLoader("service", "templates"), autoescape=True, undefined=StrictUndefined)


def render(template: str, **context: Any) -> str:
    return _env.get_template(template).render(**context)


def login_page(message: str = "") -> str:
    return render("login.html", title="elastic-train: sign in", message=message)


def not_found_page(message: str) -> str:
    return render("not_found.html", title="not found", message=message)


def fmt_time(t: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if number(t) is not None and t > 0 else "-"


def number(v: Any) -> float | None:
    """``v`` when it is a finite number, else None: job files are a tenant's, not to be trusted."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return v
    return None


def percent(v: Any) -> str:
    return "-" if number(v) is None else f"{100 * v:.0f}%"


def jobs_page(tenant: str, rows: Sequence[dict]) -> str:
    """rows: {id, name, kind, state, step, target_step, goodput, updated_at}."""
    shown = []
    for r in rows:
        step, target = number(r.get("step")), number(r.get("target_step"))
        progress = f"{step:.0f}/{target:.0f} ({100 * step / target:.0f}%)" if step is not None and target else "-"
        shown.append({"id": r["id"], "name": r["name"], "kind": r["kind"], "state": r["state"], "progress": progress,
                      "goodput": percent(r.get("goodput")), "updated": fmt_time(r.get("updated_at"))})
    return render("jobs.html", title=f"Jobs of {tenant}", rows=shown)


def chart(chart_id: str, title: str, points: Sequence[tuple[Any, Any]], marks: Sequence[Any] = (),
          width: int = 560, height: int = 220) -> dict:
    """A line chart of (x, y) with vertical marks at some x (interruptions), as numbers for the template."""
    pad_l, pad_r, pad_t, pad_b = 56, 12, 24, 28
    points = [(x, y) for x, y in points if number(x) is not None and number(y) is not None]
    marks = [m for m in marks if number(m) is not None]
    base = {"id": chart_id, "title": title, "width": width, "height": height, "pad_l": pad_l, "pad_r": pad_r,
            "pad_t": pad_t, "pad_b": pad_b, "line": "", "marks": []}
    if not points:
        return base
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs + marks), max(xs + marks)
    y0, y1 = min(ys), max(ys)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)

    def sx(x: float) -> float:
        return pad_l + (x - x0) / (x1 - x0) * (width - pad_l - pad_r)

    def sy(y: float) -> float:
        return height - pad_b - (y - y0) / (y1 - y0) * (height - pad_t - pad_b)
    return {**base, "line": " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points),
            "marks": [f"{sx(m):.1f}" for m in marks], "y_min": f"{y0:.4g}", "y_max": f"{y1:.4g}",
            "span": f"{x1 - x0:.0f}"}


def job_page(record: dict, rows: Sequence[dict], interruptions: Sequence[dict], checkpoints: Sequence[dict],
             log_tail: str) -> str:
    rows = [r for r in rows if isinstance(r, dict) and number(r.get("time")) is not None]
    interruptions = [i for i in interruptions if isinstance(i, dict)]
    start = rows[0]["time"] if rows else 0.0
    marks = [i["interrupted_at"] - start for i in interruptions if rows and number(i.get("interrupted_at")) is not None]
    loss = [(r["time"] - start, r.get("loss")) for r in rows]
    rate = [(r["time"] - start, r.get("samples_per_s")) for r in rows]
    last = rows[-1] if rows else {}
    cost = number(last.get("cost_usd"))
    return render(
        "job.html", title=f"{record['name']} ({record['id']})", state=record["state"],
        step=last.get("step", "-"), world_size=last.get("world_size", "-"), goodput=percent(last.get("goodput")),
        cost="-" if cost is None else f"${cost:.4f}",
        loss_chart=chart("loss-chart", "loss", loss, marks), rate_chart=chart("throughput-chart", "samples/s", rate,
                                                                               marks),
        interruptions=[{"cause": i.get("cause"), "at": fmt_time(i.get("interrupted_at")),
                        "steps_lost": i.get("steps_lost"), "recovery_s": i.get("recovery_s")} for i in interruptions],
        checkpoints=checkpoints, log_tail=log_tail)
