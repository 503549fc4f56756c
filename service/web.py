"""The service's own web page: a tenant's jobs, and one job's curves, interruptions, checkpoints
and log tail. Server-rendered HTML with inline SVG charts: no script, nothing from the internet.

Browsers cannot send a bearer header, so ``/ui/login`` (or ``?token=`` once) sets an HttpOnly
cookie holding the token; the same tenant rules as the API apply.
"""

from __future__ import annotations

import html
import time
from collections.abc import Sequence

STYLE = """
body{font:14px system-ui,sans-serif;margin:24px;color:#1b1f24}
table{border-collapse:collapse}td,th{padding:4px 10px;border-bottom:1px solid #ddd;text-align:left}
.state-RUNNING{color:#0a7}.state-FAILED{color:#c22}.state-SUCCEEDED{color:#25a}.state-STOPPED{color:#a70}
svg.chart{background:#fafbfc;border:1px solid #ddd;margin:8px 16px 8px 0}
svg .line{fill:none;stroke:#25a;stroke-width:1.5}svg .interruption{stroke:#c22;stroke-dasharray:4 3}
svg text{font-size:11px;fill:#555}pre{background:#f5f5f5;padding:8px;max-height:360px;overflow:auto}
"""


def page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>")


def login_page(message: str = "") -> str:
    note = f"<p style='color:#c22'>{html.escape(message)}</p>" if message else ""
    return page("elastic-train: sign in", note + "<form method='post' action='/ui/login'>"
                "<label>Token <input type='password' name='token' size='50'></label> "
                "<button type='submit'>Sign in</button></form>")


def fmt_time(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def jobs_page(tenant: str, rows: Sequence[dict]) -> str:
    """rows: {id, name, kind, state, step, target_step, goodput, updated_at}."""
    if not rows:
        return page(f"Jobs of {tenant}", "<p>No jobs yet. Submit one: <code>etrain submit SPEC</code></p>")
    lines = ["<table id='jobs'><tr><th>id</th><th>name</th><th>kind</th><th>state</th><th>progress</th>"
             "<th>goodput</th><th>updated</th></tr>"]
    for r in rows:
        progress = (f"{r['step']}/{r['target_step']} ({100 * r['step'] / r['target_step']:.0f}%)"
                    if r.get("step") is not None and r.get("target_step") else "-")
        good = f"{100 * r['goodput']:.0f}%" if r.get("goodput") is not None else "-"
        link = f"<a href='/ui/jobs/{html.escape(r['id'])}'>{html.escape(r['id'])}</a>" if r["kind"] == "job" \
            else html.escape(r["id"])
        lines.append(f"<tr class='job'><td>{link}</td><td>{html.escape(r['name'])}</td><td>{r['kind']}</td>"
                     f"<td class='state-{r['state']}'>{r['state']}</td><td>{progress}</td><td>{good}</td>"
                     f"<td>{fmt_time(r.get('updated_at'))}</td></tr>")
    lines.append("</table>")
    return page(f"Jobs of {tenant}", "".join(lines))


def svg_chart(chart_id: str, title: str, points: Sequence[tuple[float, float]], marks: Sequence[float] = (),
              width: int = 560, height: int = 220) -> str:
    """A line chart of (x, y) with vertical marks at some x (interruptions), as inline SVG."""
    pad_l, pad_r, pad_t, pad_b = 56, 12, 24, 28
    if not points:
        return (f"<svg id='{chart_id}' class='chart empty' width='{width}' height='{height}'>"
                f"<text x='{pad_l}' y='{height / 2}'>{html.escape(title)}: no data yet</text></svg>")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs + list(marks)), max(xs + list(marks))
    y0, y1 = min(ys), max(ys)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    sx = lambda x: pad_l + (x - x0) / (x1 - x0) * (width - pad_l - pad_r)  # noqa: E731
    sy = lambda y: height - pad_b - (y - y0) / (y1 - y0) * (height - pad_t - pad_b)  # noqa: E731
    line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
    parts = [f"<svg id='{chart_id}' class='chart' width='{width}' height='{height}' "
             f"viewBox='0 0 {width} {height}' role='img' aria-label='{html.escape(title)}'>",
             f"<text x='{pad_l}' y='16'>{html.escape(title)}</text>",
             f"<text x='4' y='{pad_t + 8}'>{y1:.4g}</text><text x='4' y='{height - pad_b}'>{y0:.4g}</text>",
             f"<text x='{pad_l}' y='{height - 8}'>0 s</text>"
             f"<text x='{width - pad_r - 60}' y='{height - 8}'>{x1 - x0:.0f} s</text>",
             f"<polyline class='line' points='{line}'/>"]
    for m in marks:
        parts.append(f"<line class='interruption' x1='{sx(m):.1f}' x2='{sx(m):.1f}' y1='{pad_t}' "
                     f"y2='{height - pad_b}'><title>interruption</title></line>")
    parts.append("</svg>")
    return "".join(parts)


def job_page(record: dict, rows: Sequence[dict], interruptions: Sequence[dict], checkpoints: Sequence[dict],
             log_tail: str) -> str:
    start = rows[0]["time"] if rows else 0.0
    marks = [r["interrupted_at"] - start for r in interruptions if rows and "interrupted_at" in r]
    loss = [(r["time"] - start, r["loss"]) for r in rows if r.get("loss") is not None]
    rate = [(r["time"] - start, r["samples_per_s"]) for r in rows if r.get("samples_per_s") is not None]
    last = rows[-1] if rows else {}
    good = "-" if last.get("goodput") is None else f"{100 * last['goodput']:.0f}%"
    cost = "-" if last.get("cost_usd") is None else f"${last['cost_usd']:.4f}"
    facts = (f"<p>state <b class='state-{record['state']}'>{record['state']}</b> · step {last.get('step', '-')}"
             f" · world size {last.get('world_size', '-')} · goodput {good} · cost {cost}"
             f" · <a href='/'>all jobs</a></p>")
    charts = (svg_chart("loss-chart", "loss", loss, marks)
              + svg_chart("throughput-chart", "samples/s", rate, marks))
    irows = "".join(f"<tr class='interruption-row'><td>{html.escape(str(i.get('cause')))}</td>"
                    f"<td>{fmt_time(i.get('interrupted_at'))}</td><td>{i.get('steps_lost')}</td>"
                    f"<td>{i.get('recovery_s')}</td></tr>" for i in interruptions)
    itable = ("<h2>Interruptions</h2><table id='interruptions'><tr><th>cause</th><th>at</th><th>steps lost</th>"
              f"<th>recovery s</th></tr>{irows}</table>") if interruptions else "<h2>Interruptions</h2><p>none</p>"
    crows = "".join(f"<tr class='checkpoint'><td>{c['step']}</td><td>{'complete' if c['complete'] else 'partial'}</td>"
                    f"<td>{c['size_bytes']}</td><td><code>{html.escape(c['uri'])}</code></td></tr>" for c in checkpoints)
    ctable = ("<h2>Checkpoints</h2><table id='checkpoints'><tr><th>step</th><th></th><th>bytes</th><th>uri</th></tr>"
              f"{crows}</table>")
    return page(f"{record['name']} ({record['id']})",
                facts + f"<div id='charts'>{charts}</div>" + itable + ctable
                + f"<h2>Log</h2><pre id='log'>{html.escape(log_tail)}</pre>")
