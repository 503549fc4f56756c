"""What a sweep tells at its end: a row per trial (what its job really did), the best trial, and
the results as a table."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from cluster.storage import StorageRoot
from trainers.config.loading import validate
from trainers.job_folder import SUMMARY_FILE, SWEEP_RESULTS_FILE
from trainers.sweep.spec import TIME_ATTR
from trainers.sweep.trials import trial_job_data, trial_job_name, trial_values


def result_rows(grid, metric: str, space: dict[str, dict[str, Any]]) -> list[dict]:
    """One row per trial: values, status (finished, stopped early, error), step reached, metrics."""
    rows = []
    for result in grid:
        m = result.metrics or {}
        trial_id = m.get("trial_id") or Path(result.path).name
        if result.error is not None:
            status = "error"
        elif m.get("step") is not None and m.get("target_step") and m["step"] < m["target_step"]:
            status = "stopped early"
        elif m.get("step") is None:
            status = "no result"
        else:
            status = "finished"
        rows.append({
            "trial": trial_id, "params": trial_values(space, result.config or {}),
            "status": status, "step": m.get("step"), "target_step": m.get("target_step"),
            "reports": m.get("training_iteration"), metric: m.get(metric),
            "loss": m.get("loss"), "samples_per_s": m.get("steady_samples_per_s"),
            "time_s": round(m.get("time_total_s") or 0.0, 2),
            "error": None if result.error is None else str(result.error).strip().splitlines()[-1][:300],
            "history": history(result, metric),
        })
    return sorted(rows, key=lambda r: r["trial"])


def history(result, metric: str) -> list[dict]:
    """Each report of a trial: when (Unix seconds), at which step, the metric and the loss (for curves)."""
    frame = result.metrics_dataframe
    if frame is None or frame.empty or "step" not in frame:
        return []
    cols = [c for c in dict.fromkeys(["timestamp", "step", TIME_ATTR, metric, "loss"]) if c in frame]
    return [{k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
            for row in frame[cols].to_dict("records")]


def best_row(rows: list[dict], metric: str, mode: str) -> dict | None:
    """The best trial by the final metric; a trial stopped early competes too (ASHA judged it)."""
    scored = [r for r in rows if r["status"] != "error" and isinstance(r.get(metric), (int, float))
              and not math.isnan(r[metric])]
    if not scored:
        return None
    pick = min if mode == "min" else max
    return pick(scored, key=lambda r: r[metric])


def settle_trial_summaries(rows: list[dict], base: dict, jobs: StorageRoot) -> None:
    """Give every trial stopped by the scheduler a summary that says so.

    Tune stops a trial by tearing its training down, often before the trial's own summary is
    written (or after it recorded the teardown as a failure). Its checkpoints say where it got.
    A trial reports in the background while it trains on, so it may reach its target before
    the scheduler's stop arrives: its row then says it finished, where and with what loss.
    """
    from trainers.job_folder import job_home
    from trainers.launch import latest_metrics, make_summary

    for row in rows:
        if row["status"] == "error":
            continue
        name = trial_job_name(row["trial"])
        summary = jobs.read_json(name, SUMMARY_FILE) if jobs.exists(name, SUMMARY_FILE) else {}
        if not summary or summary.get("status") == "failed":
            spec = validate(trial_job_data(base, row["params"], name, jobs.uri))
            metrics, path, _ = latest_metrics(job_home(spec))
            summary = make_summary(spec, job_home(spec), metrics, path, None, row["time_s"])
            if not reached_target(summary):  # torn down after its target, the job was done
                summary.update(status="stopped", stopped_by="sweep scheduler")
            jobs.write_json(summary, name, SUMMARY_FILE)
        if reached_target(summary) and row["status"] == "stopped early":
            row.update(status="finished", step=summary["final_step"], target_step=summary["target_step"],
                       loss=summary["final_loss"],  # the metric too, when it is the loss (the row's key)
                       scheduler_stop="came after the job reached its target")


def reached_target(summary: dict) -> bool:
    """A trial's job that got to its target step (its checkpoints say so), however it ended."""
    final, target = summary.get("final_step"), summary.get("target_step")
    return summary.get("status") == "succeeded" and final is not None and target is not None and final >= target


def render_table(report: dict) -> str:
    metric = report["metric"]
    keys = sorted({k for r in report["trials"] for k in r["params"]})
    head = ["trial", *keys, "status", "step", metric, "samples/s", "time_s"]
    lines = [head]
    for r in report["trials"]:
        lines.append([r["trial"], *(_fmt(r["params"].get(k)) for k in keys), r["status"],
                      f"{r['step']}/{r['target_step']}", _fmt(r.get(metric)), _fmt(r.get("samples_per_s")),
                      _fmt(r["time_s"])])
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def render_report(report: dict) -> str:
    """What `etrain sweep` prints at its end: the trials as a table, the best one, where the results are."""
    lines = [f"\n[etrain] sweep {report['name']}: {len(report['trials'])} trials in {report['wall_time_s']:.1f}s "
             f"({report['scheduler']} scheduler)", render_table(report)]
    best = report.get("best")
    if best:
        lines.append(f"[etrain] best: {best['trial']} {report['metric']}={_fmt(best[report['metric']])} with "
                     + ", ".join(f"{k}={_fmt(v)}" for k, v in best["params"].items()))
        lines.append(f"[etrain] best spec: {report['best_spec']}  (run it: etrain run {report['best_spec']})")
    else:
        lines.append("[etrain] no trial reported the metric: see the errors above")
    lines.append(f"[etrain] results:   {report['storage']}/{SWEEP_RESULTS_FILE}")
    return "\n".join(lines)
