"""What a tenant is shown of its records and of what their jobs wrote (read through trainers.api):
locations relative to its storage prefix, never where the server keeps things.

A job, so its tenant, writes the files read here: each is read bounded, and a damaged or hostile
one reads as absent, never as an error of the service.
"""

from __future__ import annotations

from typing import Any

from cluster.storage import StorageRoot
from service.context import JobsContext
from service.ray_failures import RayUnavailable, ray_error_status
from service.store import Record
from trainers import api as trainers


class Views:
    """Records as the API and the page show them, and what their jobs wrote."""

    def __init__(self, context: JobsContext):
        self.context = context

    def visible(self, record_id: str, tenant: str, admin: bool) -> Record | None:
        record = self.context.store.get(record_id)
        if record is None or (record.tenant != tenant and not admin):
            return None
        return record

    def list(self, kind: str, tenant: str, admin: bool, state: str | None = None) -> list[Record]:
        return [r for r in self.context.store.all() if r.kind == kind and (admin or r.tenant == tenant)
                and (state is None or r.state == state)]

    def logs(self, record: Record, tail_lines: int | None) -> str:
        """The latest attempt's log; RayUnavailable when Ray cannot give it (never a silent blank)."""
        if not record.submissions:
            return ""
        sid = record.submissions[-1]
        try:
            text = self.context.client.get_job_logs(sid)
        except Exception as exc:  # boundary: Ray's HTTP API; the caller shows the reason
            if ray_error_status(exc) == 404:
                raise RayUnavailable(f"Ray no longer has the logs of submission {sid} (its job table was lost "
                                     "with the head node); the run's summary and metrics are in storage",
                                     missing=True) from None
            raise RayUnavailable(f"Ray's Jobs API did not return the logs of {sid}: {type(exc).__name__}: "
                                 f"{str(exc)[:300]}: try again shortly") from None
        text = self.relative(record.tenant, text)
        if tail_lines is None:
            return text
        return "".join(text.splitlines(keepends=True)[-tail_lines:]) if tail_lines > 0 else ""

    def checkpoints(self, record: Record) -> list[dict]:
        troot = self.context.tenant_root(record.tenant)
        if record.kind == "sweep":
            jobs = troot.sub("sweeps", record.id, "jobs")
            return [dict(c, trial=trial, uri=f"sweeps/{record.id}/jobs/{c['path'][len(jobs.base) + 1:]}")
                    for trial in jobs.list_dirs() if trial.startswith("trial-")
                    for c in trainers.checkpoints_in(jobs, jobs.path(trial, trainers.run_folder_of(record.spec)))]
        run_path = troot.path(record.id, trainers.run_folder_of(record.spec))
        return [dict(c, uri=c["path"][len(troot.base) + 1:]) for c in trainers.checkpoints_in(troot, run_path)]

    def metrics(self, record: Record) -> list[dict]:
        if record.kind == "sweep":
            return []
        return trainers.read_history(self.context.tenant_root(record.tenant), record.id)

    def interruptions(self, record: Record) -> list[dict]:
        rows = read_tenant_json(self.context.tenant_root(record.tenant), record.id, trainers.INTERRUPTIONS_FILE)
        return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []

    def profiles(self, record: Record) -> list[str]:
        if record.kind != "job":
            return []
        troot = self.context.tenant_root(record.tenant)
        return [self.relative(record.tenant, uri) for uri in trainers.profiles(troot, record.id)]

    def summary_of(self, record: Record) -> dict | None:
        parts = (("sweeps", record.id, trainers.SWEEP_RESULTS_FILE) if record.kind == "sweep"
                 else (record.id, trainers.SUMMARY_FILE))
        summary = read_tenant_json(self.context.tenant_root(record.tenant), *parts)
        return summary if isinstance(summary, dict) else None

    def relative(self, tenant: str, text: str) -> str:
        """Locations in ``text`` relative to the tenant's storage prefix (others' to the root):
        answers never show where the server keeps things."""
        return text.replace(self.context.tenant_root(tenant).uri + "/", "").replace(self.context.root.uri + "/", "")

    def public(self, record: Record) -> dict[str, Any]:
        """A record as the API shows it: the spec as given (no server paths), locations storage-relative."""
        data = record.model_dump(mode="json", exclude={"slots", "cpus", "gpus", "spec_sha256", "state_key"})
        (data["spec"].get("checkpoint") or {}).pop("storage_root", None)
        last = (record.summary or {})
        data["progress"] = {"step": last.get("final_step"), "target_step": last.get("target_step")}
        return _map_strings(data, lambda s: self.relative(record.tenant, s))


# The most the service reads of one JSON file a job (so its tenant) writes: a summary, a sweep's results,
# interruptions. Real ones are a few KB; a bigger one is not read (it would be held, stored and answered).
TENANT_JSON_MAX_BYTES = 1 << 20


def read_tenant_json(root: StorageRoot, *parts: str) -> Any:
    """A JSON file from a tenant's prefix, or None when it is missing, over TENANT_JSON_MAX_BYTES,
    or not JSON a reader can hold (malformed, nested past the parser's depth): the job writes these
    files, so a damaged or hostile one reads as absent, never as an error of the service."""
    import pyarrow.fs as pafs

    info = root.fs.get_file_info(root.path(*parts))
    if info.type != pafs.FileType.File or info.size > TENANT_JSON_MAX_BYTES:
        return None
    try:
        return root.read_json(*parts)
    except (ValueError, RecursionError):
        return None


def _map_strings(value: Any, fn) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    return value
