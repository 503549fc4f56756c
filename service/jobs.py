"""Jobs and sweeps as Ray Jobs: submit, follow, stop gracefully, resume, reconcile with Ray.

Each record runs as Ray Jobs submissions whose entrypoint is a fixed argument list
(``<python> -m trainers.train <spec URI>``); user text never reaches a shell, and what code
a spec may name is the tenant's role's to say (service.auth). The submission id is
``etrain-<record id>-<attempt>``, so a submission repeated after a crash is refused by Ray
instead of running twice. Ray's job table dies with the head node; our records do not: a
record whose Ray job vanished is resubmitted, and it resumes from its newest checkpoint.

A job gets its tenant's prefix of the storage root and a scrubbed environment (the
service's secrets and cloud keys blanked, the tenant's own variables added); the service's
state (service.store) is in a folder no job is told of.
"""

from __future__ import annotations

import copy
import math
import os
import re
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, model_validator

from cluster.storage import StorageRoot, open_root
from service.auth import ROLES, Principal, in_tenant_data, is_under, policy_problems
from service.store import ACTIVE, TERMINAL, Record, Store, new_id
from trainers import checkpoint as ckpt
from trainers.config import SpecError, refs_not_imported, validate
from trainers.history import read_history
from trainers.recovery import StopFlag

ENTRY_MODULES = {"job": "trainers.train", "sweep": "trainers.sweep"}
STATE_DIR_ENV = "ETRAIN_STATE_DIR"
# Variables of the service's own environment that no job gets (they are blanked in its runtime_env):
# cloud credentials, tokens, passwords, and where the service keeps its state.
SECRET_ENV = re.compile(r"^(AWS_(ACCESS_KEY_ID|SECRET_ACCESS_KEY|SESSION_TOKEN|SECURITY_TOKEN|PROFILE|"
                        r"SHARED_CREDENTIALS_FILE|CONFIG_FILE|WEB_IDENTITY_TOKEN_FILE|ROLE_ARN|CONTAINER_\w+)|"
                        r"ETRAIN_TOKENS?|ETRAIN_STATE_DIR|GRAFANA_TOKEN|(?!RAY_)\w*(SECRET|PASSWORD|PASSWD|PRIVATE_KEY|"
                        r"CREDENTIALS?|API_KEY|_TOKEN)\w*)$")


SWEEP_TRIALS = {"user": 64, "code": 256, "admin": 1024}


def default_state_dir() -> str:
    return os.environ.get(STATE_DIR_ENV) or str(Path.home() / ".etrain" / "service")


class ServiceSettings(BaseModel):
    """How the service runs; `etrain serve` fills it from flags and the environment."""

    storage_root: str
    state_dir: str = Field(default_factory=default_state_dir,
                           description="the service's own state (records, keys, token hashes): a local folder on "
                                       "the service's node, outside the storage root; $ETRAIN_STATE_DIR or "
                                       "~/.etrain/service")
    ray_dashboard_url: str = Field(description="Ray's dashboard (Jobs API) URL, e.g. http://127.0.0.1:8265")
    python: str = Field(default_factory=lambda: sys.executable, description="interpreter for job entrypoints")
    max_body_bytes: int = Field(1 << 20, gt=0)
    max_active_per_tenant: int = Field(4, ge=0, description="quota: slots of unfinished jobs (1 each) and sweeps "
                                                            "(their max_concurrent_trials), per tenant")
    tenant_quotas: dict[str, int] = Field(default_factory=dict, description="per-tenant override of the quota")
    max_sweep_trials: dict[str, int] = Field(
        default_factory=dict, description=f"most trials one sweep may run, per role (default {SWEEP_TRIALS})")
    factory_modules: list[str] = Field(
        default_factory=list, description="module prefixes a 'user' tenant's model/data factories may come from, "
                                          "e.g. ['acme_models'] allows acme_models and acme_models.*")
    tenant_data_uris: dict[str, list[str]] = Field(
        default_factory=dict, description="per tenant: URIs (prefixes) a 'user' tenant may read data from besides "
                                          "its own storage prefix")
    tenant_env: dict[str, dict[str, str]] = Field(
        default_factory=dict, description="per tenant: variables its jobs get, e.g. its own AWS keys (scoped by "
                                          "IAM to its prefix); the service's own secrets never reach a job")
    stop_wait_s: float = Field(120.0, gt=0, description="graceful stop: wait this long for the final checkpoint")
    reconcile_interval_s: float = Field(5.0, gt=0)
    entrypoint_resources: dict[str, float] = Field(
        default_factory=dict, description="Ray resources a job's driver needs, e.g. {'head': 1} to keep drivers "
                                          "on the on-demand head node, never on a spot worker")

    @model_validator(mode="after")
    def _state_outside_storage(self) -> "ServiceSettings":
        if "://" not in self.storage_root and is_under(os.path.abspath(os.path.expanduser(self.state_dir)),
                                                       os.path.abspath(os.path.expanduser(self.storage_root))):
            raise ValueError(f"state_dir {self.state_dir!r} is inside the storage root, where jobs write: "
                             "put it outside (e.g. ~/.etrain/service)")
        unknown = set(self.max_sweep_trials) - set(ROLES)
        if unknown:
            raise ValueError(f"max_sweep_trials: unknown roles {sorted(unknown)}: use {', '.join(ROLES)}")
        self.max_sweep_trials = {**SWEEP_TRIALS, **self.max_sweep_trials}
        return self


class QuotaExceeded(Exception):
    pass


class Forbidden(Exception):
    """A spec that names what the tenant's role may not use; ``problems`` has one line each."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def sweep_trials(sweep) -> int:
    """Trials a sweep runs: its samples, times every grid's length (Tune multiplies them)."""
    grids = [len(d["grid"]) for d in sweep.space.values() if isinstance(d, dict) and isinstance(d.get("grid"), list)]
    return sweep.samples * math.prod(grids)


class Conflict(Exception):
    pass


def reconcile_decision(state: str, ray_status: str | None, outcome: str | None) -> tuple[str, bool]:
    """(next state, resubmit?) from Ray's view of the latest attempt and the run's own summary.

    ``ray_status`` None means Ray does not know the submission (the head restarted, or it was
    never sent); ``outcome`` is the status in the run's summary (succeeded/stopped/failed).
    """
    if state in TERMINAL:
        return state, False
    if ray_status is None:
        return ("STOPPED", False) if state == "STOPPING" else ("RUNNING", True)
    if ray_status in ("PENDING", "RUNNING"):
        return ("STOPPING" if state == "STOPPING" else "RUNNING"), False
    if ray_status == "STOPPED" or outcome == "stopped":
        return "STOPPED", False
    if ray_status == "SUCCEEDED":
        return "SUCCEEDED", False
    return "FAILED", False


class JobManager:
    def __init__(self, settings: ServiceSettings, client=None):
        from ray.job_submission import JobSubmissionClient

        self.settings = settings
        self.root = open_root(settings.storage_root)
        self.store = Store(settings.state_dir)
        self.client = client or JobSubmissionClient(settings.ray_dashboard_url)
        self._lock = threading.RLock()
        self.on_reconciled = None  # called with every record after each pass (the service's gauges)

    # ------------------------------------------------------------ where things live

    def tenant_root(self, tenant: str) -> StorageRoot:
        return self.root.sub("tenants", tenant)

    # ------------------------------------------------------------ submit

    def check_spec(self, kind: str, data: dict, who: Principal, record_id: str) -> tuple[str, dict, int]:
        """(the user's name, the spec to run, quota slots) for a submitted body.

        The role's rules come first (Forbidden), on the spec's strings alone; then the spec is
        validated without importing anything it names (SpecError lists every problem).
        """
        if not isinstance(data, dict):
            raise SpecError(["(top level): a spec is a mapping of sections"])
        tenant, troot = who.tenant, self.tenant_root(who.tenant)
        name = str(data.get("name") or kind)
        run = dict(copy.deepcopy(data), name=record_id)
        section = run.get("data")
        if isinstance(section, dict) and isinstance(section.get("source"), str):
            run["data"] = dict(section, source=in_tenant_data(section["source"], troot.uri))
        problems = policy_problems(who.role, run, self.settings.factory_modules,
                                   [troot.uri, *self.settings.tenant_data_uris.get(tenant, [])])
        if problems:
            raise Forbidden(problems)
        run["checkpoint"] = dict(run.get("checkpoint") or {}, storage_root=troot.uri)
        run["labels"] = {**(run.get("labels") if isinstance(run.get("labels"), dict) else {}), "tenant": tenant}
        with refs_not_imported():
            if kind == "sweep":
                from trainers.sweep import plan_from_data

                sweep = run.get("sweep")
                if isinstance(sweep, dict) and sweep.get("base"):
                    raise SpecError([f"sweep.base: {sweep['base']!r}: not available over HTTP: put the job spec's "
                                     "sections in the same body"])
                plan = plan_from_data(run, "sweep")
                trials, cap = sweep_trials(plan.sweep), self.settings.max_sweep_trials.get(who.role, 0)
                if trials > cap:
                    raise QuotaExceeded(f"sweep.num_samples: this sweep runs {trials} trials, role {who.role!r} may "
                                        f"run at most {cap} per sweep: lower num_samples or the grid")
                return name, run, min(plan.sweep.max_concurrent_trials, trials)
            if "sweep" in run:
                raise SpecError(["sweep: a job takes no sweep section: POST it to /v1/sweeps"])
            validate(run)
        return name, run, 1

    def quota(self, tenant: str) -> int:
        return self.settings.tenant_quotas.get(tenant, self.settings.max_active_per_tenant)

    def active_slots(self, tenant: str) -> int:
        return sum(r.slots for r in self.store.all() if r.tenant == tenant and r.state in ACTIVE)

    def check_quota(self, tenant: str, slots: int) -> None:
        active, quota = self.active_slots(tenant), self.quota(tenant)
        if active + slots > quota:
            raise QuotaExceeded(f"tenant {tenant!r} holds {active} of its quota of {quota} slots (a job takes 1, a "
                                f"sweep its max_concurrent_trials) and this needs {slots}: wait for one to finish, "
                                "stop one, or lower max_concurrent_trials")

    def create(self, kind: str, who: Principal, data: dict, idempotency_key: str | None,
               body_sha256: str) -> tuple[Record, bool]:
        """Check, store and submit; returns (record, created). A repeated Idempotency-Key returns
        the record it made the first time (and submits it if a crash cut that short)."""
        tenant = who.tenant
        with self._lock:
            if idempotency_key:
                bound = self.store.key_binding(tenant, idempotency_key)
                if bound:
                    return self._replay(bound, body_sha256), False
            record_id = new_id(kind)
            name, run, slots = self.check_spec(kind, data, who, record_id)
            self.check_quota(tenant, slots)
            if idempotency_key:
                bound = self.store.claim_key(tenant, idempotency_key, record_id, body_sha256)
                if bound["id"] != record_id:
                    return self._replay(bound, body_sha256), False
            troot = self.tenant_root(tenant)
            troot.write_json(run, "specs", f"{record_id}.json")
            if kind == "job":  # goodput counts from here, queueing included
                troot.write_json({"submitted_at": time.time()}, record_id, "job.json")
            now = time.time()
            record = Record(id=record_id, kind=kind, tenant=tenant, name=name, spec=run,
                            spec_uri=troot.uri_of("specs", f"{record_id}.json"),
                            storage=troot.uri_of(self.run_folder_for(kind, record_id)), slots=slots,
                            created_at=now, updated_at=now)
            record.move("PENDING", "submitted")
            self.store.save(record)
        # Outside the lock: Ray's HTTP call need not serialise submits. A racing retry of the same
        # key submits the same submission id, which Ray refuses: still one job.
        return self.submit(record), True

    @staticmethod
    def run_folder_for(kind: str, record_id: str) -> str:
        return f"sweeps/{record_id}" if kind == "sweep" else record_id

    def _replay(self, bound: dict, body_sha256: str) -> Record:
        if bound.get("body_sha256") != body_sha256:
            raise Conflict("this Idempotency-Key was used with a different body: use a new key for a new job")
        record = self.store.get(bound["id"])
        if record is None:
            raise Conflict("this Idempotency-Key's first request did not finish storing its job: retry with a new key")
        if not record.submissions:
            record = self.submit(record)
        return record

    def entrypoint(self, record: Record, resume: bool) -> str:
        args = [self.settings.python, "-m", ENTRY_MODULES[record.kind], record.spec_uri]
        if record.kind == "sweep" and resume:
            args.append("--resume")
        if record.kind == "job":  # the log keeps Ray's lines too: the page tells them apart and filters
            args.append("--verbose")
        return shlex.join(args)  # every word is ours or a storage URI we made, quoted all the same

    def job_env(self, tenant: str) -> dict[str, str]:
        """The variables a tenant's job runs with, over what Ray's workers inherit: the service's
        secrets blanked, the default storage root set to the tenant's prefix, the tenant's own added."""
        env = {k: "" for k in os.environ if SECRET_ENV.match(k)}
        env["ETRAIN_STORAGE_ROOT"] = self.tenant_root(tenant).uri
        env.update(self.settings.tenant_env.get(tenant, {}))
        return env

    def submit(self, record: Record, reason: str = "submitted to Ray") -> Record:
        """Start the record's next attempt. The submission id is saved before Ray hears of it."""
        attempt = len(record.submissions)
        sid = f"etrain-{record.id}-{attempt}"
        record.submissions.append(sid)
        self.store.save(record)
        try:
            self.client.submit_job(entrypoint=self.entrypoint(record, resume=attempt > 0), submission_id=sid,
                                   metadata={"etrain_record": record.id, "tenant": record.tenant},
                                   runtime_env={"env_vars": self.job_env(record.tenant)},
                                   entrypoint_resources=self.settings.entrypoint_resources or None)
        except RuntimeError as exc:
            if "already exists" not in str(exc):
                record.error = f"Ray refused the submission: {exc}"
                record.move("FAILED", "submission refused")
                self.store.save(record)
                return record
        record.error = None
        record.move("RUNNING", reason)
        self.store.save(record)
        return record

    # ------------------------------------------------------------ read

    def visible(self, record_id: str, tenant: str, admin: bool) -> Record | None:
        record = self.store.get(record_id)
        if record is None or (record.tenant != tenant and not admin):
            return None
        return record

    def list(self, kind: str, tenant: str, admin: bool, state: str | None = None) -> list[Record]:
        return [r for r in self.store.all() if r.kind == kind and (admin or r.tenant == tenant)
                and (state is None or r.state == state)]

    def logs(self, record: Record, tail_lines: int | None) -> str:
        if not record.submissions:
            return ""
        try:
            text = self.client.get_job_logs(record.submissions[-1])
        except RuntimeError:
            return ""
        text = self.relative(record.tenant, text)
        if tail_lines is None:
            return text
        return "".join(text.splitlines(keepends=True)[-tail_lines:]) if tail_lines > 0 else ""

    def checkpoints(self, record: Record) -> list[dict]:
        troot = self.tenant_root(record.tenant)
        if record.kind == "sweep":
            jobs = troot.sub("sweeps", record.id, "jobs")
            return [dict(c, trial=trial, uri=f"sweeps/{record.id}/jobs/{c['path'][len(jobs.base) + 1:]}")
                    for trial in jobs.list_dirs() if trial.startswith("trial-")
                    for c in ckpt.list_checkpoints(jobs.fs, jobs.path(trial, self._ckpt_folder(record)))]
        run_path = troot.path(record.id, self._ckpt_folder(record))
        return [dict(c, uri=c["path"][len(troot.base) + 1:]) for c in ckpt.list_checkpoints(troot.fs, run_path)]

    @staticmethod
    def _ckpt_folder(record: Record) -> str:
        from trainers.config import JobSpec

        spec = {k: v for k, v in record.spec.items() if k != "sweep"}
        with refs_not_imported():
            return JobSpec.model_validate(spec).checkpoint.run_folder

    def metrics(self, record: Record) -> list[dict]:
        if record.kind == "sweep":
            return []
        return read_history(self.tenant_root(record.tenant), record.id)

    def interruptions(self, record: Record) -> list[dict]:
        from trainers.recovery import INTERRUPTIONS_FILE

        troot = self.tenant_root(record.tenant)
        try:
            rows = troot.read_json(record.id, INTERRUPTIONS_FILE) if troot.exists(record.id, INTERRUPTIONS_FILE) else []
        except ValueError:  # the job writes this file: a damaged one lists nothing
            return []
        return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []

    def profiles(self, record: Record) -> list[str]:
        from trainers.observe import profiles_of

        if record.kind != "job":
            return []
        return [self.relative(record.tenant, uri) for uri in profiles_of(self.tenant_root(record.tenant), record.id)]

    def summary_of(self, record: Record) -> dict | None:
        troot = self.tenant_root(record.tenant)
        parts = ("sweeps", record.id, "results.json") if record.kind == "sweep" else (record.id, "summary.json")
        try:
            summary = troot.read_json(*parts) if troot.exists(*parts) else None
        except ValueError:  # the job writes this file: a damaged one is no summary
            return None
        return summary if isinstance(summary, dict) else None

    # ------------------------------------------------------------ stop and resume

    def stop(self, record: Record) -> Record:
        """Graceful: ask for a final checkpoint; Ray's stop (SIGTERM, then SIGKILL) only after stop_wait_s."""
        with self._lock:
            record = self.store.get(record.id)
            if record.state in TERMINAL:
                raise Conflict(f"{record.kind} {record.id} is already {record.state}: nothing to stop")
            if record.state == "STOPPING":
                return record
            if record.kind == "job":
                StopFlag(record.id).request()
            record.move("STOPPING", "stop requested")
            self.store.save(record)
        sid = record.submissions[-1] if record.submissions else None
        if sid:
            grace = self.settings.stop_wait_s if record.kind == "job" else 0.0
            threading.Thread(target=self._escalate, args=(record.id, sid, grace), daemon=True).start()
        return record

    def _escalate(self, record_id: str, sid: str, grace_s: float) -> None:
        deadline = time.time() + grace_s
        while time.time() < deadline:
            if self._ray_status(sid) not in ("PENDING", "RUNNING"):
                break
            time.sleep(0.5)
        else:
            try:
                self.client.stop_job(sid)  # SIGTERM, which our driver also turns into a checkpointed stop
            except RuntimeError:
                pass
        self.reconcile_one(record_id)

    def resume(self, record: Record) -> Record:
        with self._lock:
            record = self.store.get(record.id)
            if record.state not in ("STOPPED", "FAILED"):
                raise Conflict(f"{record.kind} {record.id} is {record.state}: only a STOPPED or FAILED one resumes")
            self.check_quota(record.tenant, record.slots)
            return self.submit(record, reason="resumed")

    # ------------------------------------------------------------ reconcile

    def _ray_status(self, sid: str) -> str | None:
        try:
            return str(self.client.get_job_status(sid).value)
        except RuntimeError:  # Ray has no such submission (its job table died with the head)
            return None

    def reconcile_one(self, record_id: str) -> Record | None:
        with self._lock:
            record = self.store.get(record_id)
            if record is None or record.state in TERMINAL:
                return record
            ray_status = self._ray_status(record.submissions[-1]) if record.submissions else None
            summary = self.summary_of(record) if ray_status not in ("PENDING", "RUNNING") else None
            outcome = (summary or {}).get("status") if record.kind == "job" else None
            state, resubmit = reconcile_decision(record.state, ray_status, outcome)
            if summary is not None:
                record.summary = summary
            if resubmit:
                return self.submit(record, reason="Ray lost the job (head restarted?): resubmitted from its checkpoint")
            if record.move(state, f"Ray says {ray_status}") or summary is not None:
                self.store.save(record)
            return record

    def reconcile_all(self) -> None:
        for record in self.store.all():
            if record.state not in TERMINAL:
                self.reconcile_one(record.id)
        if self.on_reconciled:
            self.on_reconciled(self.store.all())

    def run_reconciler(self, stop: threading.Event) -> None:
        while not stop.wait(self.settings.reconcile_interval_s):
            try:
                self.reconcile_all()
            except Exception as exc:  # boundary: the timer must outlive one bad poll; the next one retries
                print(f"[etrain-service] reconcile failed: {type(exc).__name__}: {exc}", file=sys.stderr)


    # ------------------------------------------------------------ what a tenant is shown

    def relative(self, tenant: str, text: str) -> str:
        """Locations in ``text`` relative to the tenant's storage prefix (others' to the root):
        answers never show where the server keeps things."""
        return text.replace(self.tenant_root(tenant).uri + "/", "").replace(self.root.uri + "/", "")

    def public(self, record: Record) -> dict[str, Any]:
        """A record as the API shows it: the spec as given (no server paths), locations storage-relative."""
        data = record.model_dump(mode="json", exclude={"slots"})
        (data["spec"].get("checkpoint") or {}).pop("storage_root", None)
        last = (record.summary or {})
        data["progress"] = {"step": last.get("final_step"), "target_step": last.get("target_step")}
        return _map_strings(data, lambda s: self.relative(record.tenant, s))


def _map_strings(value: Any, fn) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    return value
