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

Ray's Jobs API is an outside service that fails like one (5xx, timeouts, refused
connections). Only Ray's own "no such job" (404) for the latest submission, with no other
submission of the record alive, counts as "the job vanished"; any other error leaves the
record as it is, says so on the record and in the log, and is retried with back-off.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import shlex
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from cluster.ray_adapter.dashboard import dashboard_client
from cluster.signed_fs import KEY_ENV as STATE_KEY_ENV
from cluster.signed_fs import new_key
from cluster.storage import StorageRoot, open_root
from service.auth import ROLES, Principal, in_tenant_data, is_under, policy_problems
from service.limits import (DEFAULT_ROLE_LIMITS, Footprint, RoleLimits, job_footprint, limit_problems_of,
                            quota_problem, sweep_footprint)
from service.store import ACTIVE, TERMINAL, Record, Store, new_id
from trainers import api as trainers
from trainers.api import NAME_PATTERN, SpecError

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
    allowed_factories: list[str] = Field(
        default_factory=list, description="the exact 'module:function' names a 'user' tenant's model/data "
                                          "factories may be, e.g. ['acme_models.vision:make_resnet']; every "
                                          "other name in those modules stays refused")
    tenant_data_uris: dict[str, list[str]] = Field(
        default_factory=dict, description="per tenant: URIs (prefixes) a 'user' tenant may read data from besides "
                                          "its own storage prefix")
    tenant_env: dict[str, dict[str, str]] = Field(
        default_factory=dict, description="per tenant: variables its jobs get, e.g. its own AWS keys (scoped by "
                                          "IAM to its prefix); the service's own secrets never reach a job")
    role_limits: dict[str, RoleLimits] = Field(
        default_factory=dict, description="per role: the most one job may ask for (workers, resources per worker, "
                                          "loader processes, model size, steps, retries...); roles not given keep "
                                          "the defaults (service.limits.DEFAULT_ROLE_LIMITS)")
    cpu_quota: float = Field(64, ge=0, description="quota: CPUs a tenant's unfinished jobs and sweeps may hold, "
                                                   "every worker at the top of its range")
    gpu_quota: float = Field(16, ge=0, description="quota: GPUs likewise (a worker that may use GPUs counts one)")
    tenant_cpu_quotas: dict[str, float] = Field(default_factory=dict, description="per-tenant override of cpu_quota")
    tenant_gpu_quotas: dict[str, float] = Field(default_factory=dict, description="per-tenant override of gpu_quota")
    stop_wait_s: float = Field(120.0, gt=0, description="graceful stop: wait this long for the final checkpoint")
    reconcile_interval_s: float = Field(5.0, gt=0)
    jobs_token_file: str | None = Field(
        None, description="the jobs cluster's Ray token, in a file only the service reads: for a jobs cluster apart "
                          "from the service's own Ray (as `code` tenants need), with a token of its own")
    entrypoint_resources: dict[str, float] = Field(
        default_factory=dict, description="Ray resources a job's driver needs, e.g. {'head': 1} to keep drivers "
                                          "on the on-demand head node, never on a spot worker")

    @model_validator(mode="before")
    @classmethod
    def _no_module_allow_list(cls, data: Any) -> Any:
        if isinstance(data, dict) and "factory_modules" in data:
            raise ValueError("factory_modules: replaced by allowed_factories, which lists each allowed factory "
                             "exactly ('acme_models.vision:make_resnet'): a whole module let a tenant call any "
                             "function, class or imported name in it")
        return data

    @field_validator("allowed_factories")
    @classmethod
    def _exact_refs(cls, refs: list[str]) -> list[str]:
        bad = [r for r in refs if not re.fullmatch(trainers.REF_PATTERN, r)]
        if bad:
            raise ValueError(f"allowed_factories: {bad[0]!r} is not 'package.module:function': name each factory "
                             "exactly, e.g. 'acme_models.vision:make_resnet'")
        return refs

    @model_validator(mode="after")
    def _state_outside_storage(self) -> "ServiceSettings":
        if "://" not in self.storage_root and is_under(os.path.abspath(os.path.expanduser(self.state_dir)),
                                                       os.path.abspath(os.path.expanduser(self.storage_root))):
            raise ValueError(f"state_dir {self.state_dir!r} is inside the storage root, where jobs write: "
                             "put it outside (e.g. ~/.etrain/service)")
        for field in ("max_sweep_trials", "role_limits"):
            unknown = set(getattr(self, field)) - set(ROLES)
            if unknown:
                raise ValueError(f"{field}: unknown roles {sorted(unknown)}: use {', '.join(ROLES)}")
        self.max_sweep_trials = {**SWEEP_TRIALS, **self.max_sweep_trials}
        self.role_limits = {**DEFAULT_ROLE_LIMITS, **self.role_limits}
        return self


def jobs_headers(settings: ServiceSettings) -> dict[str, str]:
    """The Authorization header for the jobs cluster, when it has a token of its own."""
    if not settings.jobs_token_file:
        return {}
    path = os.path.expanduser(settings.jobs_token_file)
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"jobs_token_file {settings.jobs_token_file!r}: cannot read it ({exc.strerror}): give the "
                         "file holding the jobs cluster's Ray token (`ray get-auth-token` on its head)") from None
    if not token:
        raise ValueError(f"jobs_token_file {settings.jobs_token_file!r} is empty: put the jobs cluster's Ray token in it")
    return {"Authorization": f"Bearer {token}"}


class QuotaExceeded(Exception):
    pass


@dataclass(frozen=True)
class Checked:
    """A submitted spec once checked: the user's name for it, the spec to run, what it holds of the quota."""

    name: str
    run: dict
    slots: int
    footprint: Footprint


class Forbidden(Exception):
    """A spec that names what the tenant's role may not use; ``problems`` has one line each."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def sweep_trials(sweep) -> int:
    """Trials a sweep runs: its samples, times the length of every list Tune enumerates (every grid,
    and under search: grid every choice too; Tune multiplies them)."""
    enumerated = ("grid", "choice") if sweep.search == "grid" else ("grid",)
    lists = [len(arg) for d in sweep.space.values() if isinstance(d, dict)
             for kind, arg in d.items() if kind in enumerated and isinstance(arg, list)]
    return sweep.samples * math.prod(lists)


class RayUnavailable(Exception):
    """Ray's Jobs API did not answer (or no longer has the submission); the message says which."""

    def __init__(self, message: str, missing: bool = False):
        super().__init__(message)
        self.missing = missing


# What the reconciler may learn of a submission besides Ray's own statuses.
MISSING = "MISSING"  # Ray answered 404: it does not know the submission (its job table died with the head)
UNREACHABLE = "UNREACHABLE"  # no answer we can act on: 5xx, timeout, refused connection
Action = Literal["resubmit", "stop", "wait"] | None


def ray_error_status(exc: BaseException) -> int | None:
    """The HTTP status in an error from Ray's JobSubmissionClient, None when there was no answer.

    The client raises RuntimeError("Request failed with status code 404: ...") for any
    non-200 (dashboard_sdk._raise_error); tests/unit/test_reconcile.py checks that wording
    against the real client, so a change in Ray fails there, not here in production.
    """
    match = re.search(r"status code (\d{3})", str(exc)) if isinstance(exc, RuntimeError) else None
    return int(match.group(1)) if match else None


def submission_retryable(exc: BaseException) -> bool:
    """Whether Ray's Jobs API said "not now" to a submission rather than "no".

    A head whose job agent has not registered yet answers 500 "No available agent to submit
    job, please try again later"; a restarting or overloaded dashboard answers 502/503/504 or
    not at all. A 4xx, or any other 500, is a refusal that sending again would not change.
    """
    import requests

    if isinstance(exc, (requests.ConnectionError, requests.Timeout, ConnectionError, TimeoutError)):
        return True
    status = ray_error_status(exc)
    return status in (502, 503, 504) or (status == 500 and "try again later" in str(exc))


def backoff_s(failures: int, base_s: float, cap_s: float = 60.0) -> float:
    """How long to leave a record alone after ``failures`` failed passes in a row."""
    return min(cap_s, base_s * 2 ** max(0, failures - 1)) if failures else 0.0


class Conflict(Exception):
    pass


def reconcile_decision(state: str, ray_status: str | None, outcome: str | None, others_alive: bool = False,
                       stop_overdue: bool = False) -> tuple[str, Action]:
    """(next state, action) from Ray's view of the latest attempt and the run's own summary.

    ``ray_status`` is Ray's status, MISSING (Ray answered 404), UNREACHABLE (no usable
    answer), or None (never submitted); ``outcome`` is the status in the run's summary
    (succeeded/stopped/failed); ``others_alive``: another submission of the record still runs
    in Ray; ``stop_overdue``: a graceful stop's grace period is over and Ray still runs it.
    Actions: resubmit (the job is known gone), send (the submission Ray never took, same id),
    stop (ask Ray again), wait (back off, retry).
    """
    if state in TERMINAL:
        return state, None
    if ray_status == UNREACHABLE:
        return state, "wait"
    if ray_status in (None, MISSING):
        if state == "STOPPING":
            return "STOPPED", None
        if state == "PENDING" and ray_status == MISSING:  # Ray never took it: send the same id again
            return "PENDING", "send"
        return "RUNNING", (None if others_alive else "resubmit")
    if ray_status in ("PENDING", "RUNNING"):
        if state == "STOPPING":
            return "STOPPING", ("stop" if stop_overdue else None)
        return "RUNNING", None
    if ray_status == "STOPPED" or outcome == "stopped":
        return "STOPPED", None
    if ray_status == "SUCCEEDED":
        return "SUCCEEDED", None
    return "FAILED", None


class JobManager:
    def __init__(self, settings: ServiceSettings, client=None):
        from ray.job_submission import JobSubmissionClient

        self.settings = settings
        self.root = open_root(settings.storage_root)
        self.store = Store(settings.state_dir)
        self.client = client or dashboard_client(JobSubmissionClient, settings.ray_dashboard_url, jobs_headers(settings))
        self._lock = threading.RLock()
        self.on_reconciled = None  # called with every record after each pass (the service's gauges)
        self.on_reconcile_error = None  # called with the kind of each failed step (the service's counter)
        self._failures: dict[str, tuple[int, float]] = {}  # record id -> (failed passes in a row, retry at)
        self._last_ray_error = ""

    # ------------------------------------------------------------ where things live

    def tenant_root(self, tenant: str) -> StorageRoot:
        return self.root.sub("tenants", tenant)

    def specs_root(self, tenant: str) -> StorageRoot:
        """Where a tenant's checked specs are stored: beside its prefix, not in it (its keys write there),
        and each attempt checks the digest besides."""
        return self.root.sub("checked-specs", tenant)

    # ------------------------------------------------------------ submit

    def check_spec(self, kind: str, data: dict, who: Principal, record_id: str) -> Checked:
        """The user's name, the spec to run, its quota slots and footprint, for a submitted body.

        The role's rules come first (Forbidden), on the spec's strings alone; then the spec is
        validated without importing anything it names (SpecError lists every problem); then what it
        asks for against the role's maxima (Forbidden), every trial of a sweep included. The checks
        see the data source as given, so their messages echo it and never the server's paths; it is
        placed under the tenant's prefix only in the spec to run.
        """
        if not isinstance(data, dict):
            raise SpecError(["(top level): a spec is a mapping of sections"])
        tenant, troot = who.tenant, self.tenant_root(who.tenant)
        problems = policy_problems(who.role, data, self.settings.allowed_factories, troot.uri,
                                   self.settings.tenant_data_uris.get(tenant, []))
        if problems:
            raise Forbidden(problems)
        name = data.get("name", kind)
        if not (isinstance(name, str) and re.fullmatch(NAME_PATTERN, name)):
            raise SpecError([f"name: {json.dumps(name, default=str)[:80]}: use lowercase letters, digits, '.', '_' or "
                             "'-', starting with a letter or digit, at most 63 characters"])
        run = dict(copy.deepcopy(data), name=record_id)
        run["checkpoint"] = dict(run.get("checkpoint") or {}, storage_root=troot.uri)
        if isinstance(run["checkpoint"].get("path"), str):  # an absolute path stays in the tenant's job folder
            run["checkpoint"]["path"] = run["checkpoint"]["path"].lstrip("/")
        run["labels"] = {**(run.get("labels") if isinstance(run.get("labels"), dict) else {}), "tenant": tenant}
        slots = 1
        limits = self.settings.role_limits[who.role]
        if kind == "sweep":
            sweep = run.get("sweep")
            if isinstance(sweep, dict) and sweep.get("base"):
                raise SpecError([f"sweep.base: {sweep['base']!r}: not available over HTTP: put the job spec's "
                                 "sections in the same body"])
            plan = trainers.check_sweep(run)
            trials, cap = sweep_trials(plan.sweep), self.settings.max_sweep_trials.get(who.role, 0)
            if trials > cap:
                raise QuotaExceeded(f"sweep.num_samples: this sweep runs {trials} trials, role {who.role!r} may "
                                    f"run at most {cap} per sweep: lower num_samples or the grid")
            slots = min(plan.sweep.max_concurrent_trials, trials)
            specs = trainers.trial_specs(plan)
            footprint = sweep_footprint(specs, slots)
        elif "sweep" in run:
            raise SpecError(["sweep: a job takes no sweep section: POST it to /v1/sweeps"])
        else:
            specs = [trainers.check_job(run)]
            footprint = job_footprint(specs[0])
        over = limit_problems_of(who.role, specs, limits)
        if over:
            raise Forbidden(over)
        section = run.get("data")
        if isinstance(section, dict) and isinstance(section.get("source"), str):
            run["data"] = dict(section, source=in_tenant_data(section["source"], troot.uri))
        return Checked(name, run, slots, footprint)

    def limits_of_record(self, record: Record, role: str) -> list[str]:
        """What a stored record asks for over ``role``'s maxima of today (every trial of a sweep)."""
        if record.kind == "sweep":
            specs = trainers.trial_specs(trainers.check_sweep(record.spec))
        else:
            specs = [trainers.check_job(record.spec)]
        return limit_problems_of(role, specs, self.settings.role_limits[role])

    def quota(self, tenant: str) -> int:
        return self.settings.tenant_quotas.get(tenant, self.settings.max_active_per_tenant)

    def active_slots(self, tenant: str) -> int:
        return sum(r.slots for r in self.store.all() if r.tenant == tenant and r.state in ACTIVE)

    def held(self, tenant: str) -> Footprint:
        active = [r for r in self.store.all() if r.tenant == tenant and r.state in ACTIVE]
        return Footprint(cpus=sum(r.cpus for r in active), gpus=sum(r.gpus for r in active))

    def check_quota(self, tenant: str, slots: int, asked: Footprint) -> None:
        active, quota = self.active_slots(tenant), self.quota(tenant)
        if active + slots > quota:
            raise QuotaExceeded(f"tenant {tenant!r} holds {active} of its quota of {quota} slots (a job takes 1, a "
                                f"sweep its max_concurrent_trials) and this needs {slots}: wait for one to finish, "
                                "stop one, or lower max_concurrent_trials")
        s = self.settings
        problem = quota_problem(tenant, self.held(tenant), asked, s.tenant_cpu_quotas.get(tenant, s.cpu_quota),
                                s.tenant_gpu_quotas.get(tenant, s.gpu_quota))
        if problem:
            raise QuotaExceeded(problem)

    def create(self, kind: str, who: Principal, data: dict, idempotency_key: str | None,
               body_sha256: str) -> tuple[Record, bool]:
        """Check, store and submit; returns (record, created). A repeated Idempotency-Key returns
        the record it made the first time (and submits it if a crash cut that short)."""
        tenant = who.tenant
        if idempotency_key:
            with self._lock:
                bound = self.store.key_binding(tenant, idempotency_key)
                if bound:
                    return self._replay(bound, body_sha256), False
        # Outside the lock: checking a spec is the slow part of a submit, and other tenants' requests
        # need not wait for it. The quota, the key and the record are taken together under it.
        record_id = new_id(kind)
        checked = self.check_spec(kind, data, who, record_id)
        name, run, slots = checked.name, checked.run, checked.slots
        with self._lock:
            self.check_quota(tenant, slots, checked.footprint)
            if idempotency_key:
                bound = self.store.claim_key(tenant, idempotency_key, record_id, body_sha256)
                if bound["id"] != record_id:
                    return self._replay(bound, body_sha256), False
            troot = self.tenant_root(tenant)
            if kind == "job":  # goodput counts from here, queueing included
                troot.write_json({"submitted_at": time.time()}, record_id, "job.json")
            now = time.time()
            record = Record(id=record_id, kind=kind, tenant=tenant, name=name, spec=run,
                            spec_uri=self.specs_root(tenant).uri_of(f"{record_id}.json"),  # written by submit
                            storage=troot.uri_of(self.run_folder_for(kind, record_id)), slots=slots,
                            cpus=checked.footprint.cpus, gpus=checked.footprint.gpus,
                            state_key=new_key() if kind == "sweep" else None,
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
        args = [self.settings.python, "-m", ENTRY_MODULES[record.kind], record.spec_uri, "--spec-sha256",
                record.spec_sha256]  # set by submit, which stores the spec for each attempt
        if record.kind == "sweep" and resume:
            args.append("--resume")
        if record.kind == "job":  # the log keeps Ray's lines too: the page tells them apart and filters
            args.append("--verbose")
        return shlex.join(args)  # every word is ours or a storage URI we made, quoted all the same

    def job_env(self, record: Record) -> dict[str, str]:
        """The variables a record's job runs with, over what Ray's workers inherit: the service's
        secrets blanked, the default storage root set to the tenant's prefix, the tenant's own added,
        and a sweep's key for its Tune state last (no tenant variable may replace it)."""
        env = {k: "" for k in os.environ if SECRET_ENV.match(k)}
        env["ETRAIN_STORAGE_ROOT"] = self.tenant_root(record.tenant).uri
        env.update(self.settings.tenant_env.get(record.tenant, {}))
        env[STATE_KEY_ENV] = record.state_key or ""
        return env

    def store_spec(self, tenant: str, record_id: str, spec: dict) -> tuple[str, str]:
        """Write the spec the service checked where the tenant's keys do not write; (its URI, its SHA-256)."""
        data = json.dumps(spec, indent=2, sort_keys=True).encode()
        specs = self.specs_root(tenant)
        specs.write_bytes(data, f"{record_id}.json")
        return specs.uri_of(f"{record_id}.json"), hashlib.sha256(data).hexdigest()

    def submit(self, record: Record, reason: str = "submitted to Ray") -> Record:
        """Start the record's next attempt. The submission id is saved before Ray hears of it.

        Every attempt runs the service's own copy of the spec, written anew with its digest: a record
        made before specs were stored apart (in the tenant's prefix, with no digest) never runs the
        file its tenant could have rewritten since. A sweep without a key for its Tune state gets one,
        so Tune's unsigned state from before is refused on resume rather than unpickled."""
        record.spec_uri, record.spec_sha256 = self.store_spec(record.tenant, record.id, record.spec)
        if record.kind == "sweep" and not record.state_key:
            record.state_key = new_key()
        record.submissions.append(f"etrain-{record.id}-{len(record.submissions)}")
        self.store.save(record)
        return self._send(record, reason)

    def _send(self, record: Record, reason: str) -> Record:
        """Hand the record's latest submission to Ray. Ray's "try again later" (no job agent yet,
        a 502/503/504, no answer) leaves the record PENDING under back-off: the reconciler sends
        the same submission id again, so Ray runs it once. Any other refusal fails the record."""
        sid = record.submissions[-1]
        try:
            self.client.submit_job(entrypoint=self.entrypoint(record, resume=len(record.submissions) > 1),
                                   submission_id=sid, metadata={"etrain_record": record.id, "tenant": record.tenant},
                                   runtime_env={"env_vars": self.job_env(record)},
                                   entrypoint_resources=self.settings.entrypoint_resources or None)
        except Exception as exc:  # boundary: Ray's HTTP API
            if "already exists" not in str(exc):  # Ray has it: a retry of a submission it took
                if submission_retryable(exc):
                    if record.move("PENDING", "waiting for Ray's Jobs API"):
                        self.store.save(record)
                    self._failed(record.id, "submit", f"Ray did not take submission {sid} yet "
                                 f"({type(exc).__name__}: {str(exc)[:200]}); the service sends it again")
                    return self.store.get(record.id)
                record.error = f"Ray refused the submission: {exc}"
                record.move("FAILED", "submission refused")
                self.store.save(record)
                return record
        self._failures.pop(record.id, None)
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
        """The latest attempt's log; RayUnavailable when Ray cannot give it (never a silent blank)."""
        if not record.submissions:
            return ""
        sid = record.submissions[-1]
        try:
            text = self.client.get_job_logs(sid)
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
        troot = self.tenant_root(record.tenant)
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
        return trainers.read_history(self.tenant_root(record.tenant), record.id)

    def interruptions(self, record: Record) -> list[dict]:
        rows = read_tenant_json(self.tenant_root(record.tenant), record.id, trainers.INTERRUPTIONS_FILE)
        return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []

    def profiles(self, record: Record) -> list[str]:
        if record.kind != "job":
            return []
        return [self.relative(record.tenant, uri) for uri in trainers.profiles(self.tenant_root(record.tenant),
                                                                                record.id)]

    def summary_of(self, record: Record) -> dict | None:
        parts = ("sweeps", record.id, "results.json") if record.kind == "sweep" else (record.id, "summary.json")
        summary = read_tenant_json(self.tenant_root(record.tenant), *parts)
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
            if record.kind == "job":  # in storage, which the jobs reach wherever their Ray is
                trainers.request_stop(record.spec)
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
            self._ray_stop(record_id, sid)
        self.reconcile_one(record_id)

    def _ray_stop(self, record_id: str, sid: str) -> bool:
        """Ask Ray to stop a submission (SIGTERM, which our driver turns into a checkpointed stop).

        A failure is said on the record and in the log; the reconciler asks again each pass.
        """
        try:
            self.client.stop_job(sid)
            return True
        except Exception as exc:  # boundary: Ray's HTTP API; the next reconcile pass retries
            self._failed(record_id, "stop", f"Ray did not stop {sid} ({type(exc).__name__}: {str(exc)[:200]}); "
                                    "asking again at the next reconcile pass")
            return False

    def resume(self, record: Record, who: Principal) -> Record:
        """Start the next attempt of a stopped or failed record, under today's rules for the one who
        asks: an allow-list or a role changed since the submit applies to the resume too."""
        with self._lock:
            record = self.store.get(record.id)
            if record.state not in ("STOPPED", "FAILED"):
                raise Conflict(f"{record.kind} {record.id} is {record.state}: only a STOPPED or FAILED one resumes")
            problems = policy_problems(who.role, record.spec, self.settings.allowed_factories,
                                       self.tenant_root(record.tenant).uri,
                                       self.settings.tenant_data_uris.get(record.tenant, []))
            if not problems:
                problems = self.limits_of_record(record, who.role)
            if problems:
                raise Forbidden(problems)
            self.check_quota(record.tenant, record.slots, Footprint(record.cpus, record.gpus))
            return self.submit(record, reason="resumed")

    # ------------------------------------------------------------ reconcile

    def _ray_status(self, sid: str) -> str:
        """Ray's status of a submission, MISSING (404) or UNREACHABLE (any other failure)."""
        try:
            return str(self.client.get_job_status(sid).value)
        except Exception as exc:  # boundary: Ray's HTTP API; only a 404 means "no such submission"
            if ray_error_status(exc) == 404:
                return MISSING
            self._last_ray_error = f"{type(exc).__name__}: {str(exc)[:300]}"
            return UNREACHABLE

    def _others_alive(self, record: Record) -> bool | None:
        """Whether Ray still runs an earlier submission of the record; None when Ray did not say."""
        try:
            jobs = self.client.list_jobs()
        except Exception as exc:  # boundary: Ray's HTTP API; the caller backs off
            self._last_ray_error = f"{type(exc).__name__}: {str(exc)[:300]}"
            return None
        return any(j.submission_id in record.submissions and str(j.status.value) in ("PENDING", "RUNNING")
                   for j in jobs)

    def _failed(self, record_id: str, kind: str, reason: str) -> None:
        """One failed step for a record: on the record (error), in the log, on the counter; back off."""
        failures = self._failures.get(record_id, (0, 0.0))[0] + 1
        wait_s = backoff_s(failures, self.settings.reconcile_interval_s)
        self._failures[record_id] = (failures, time.monotonic() + wait_s)
        message = f"{reason} (failure {failures} in a row; next try in {wait_s:.0f}s)"
        print(f"[etrain-service] {record_id}: {message}", file=sys.stderr, flush=True)
        if self.on_reconcile_error:
            self.on_reconcile_error(kind)
        with self._lock:
            record = self.store.get(record_id)
            if record is not None and record.error != message:
                record.error = message
                self.store.save(record)

    def _recovered(self, record: Record) -> None:
        if self._failures.pop(record.id, None) and record.error:
            record.error = None
            self.store.save(record)

    def stop_overdue(self, record: Record, now: float) -> bool:
        """Whether a graceful stop's grace period is over (from the record's STOPPING transition)."""
        since = next((t.at for t in reversed(record.history) if t.state == "STOPPING"), record.updated_at)
        grace = self.settings.stop_wait_s if record.kind == "job" else 0.0
        return now - since > grace

    def reconcile_one(self, record_id: str) -> Record | None:
        with self._lock:
            record = self.store.get(record_id)
            if record is None or record.state in TERMINAL:
                return record
            sid = record.submissions[-1] if record.submissions else None
            ray_status = self._ray_status(sid) if sid else None
            others_alive = False
            if ray_status == MISSING and len(record.submissions) > 1:
                alive = self._others_alive(record)
                ray_status, others_alive = (UNREACHABLE, False) if alive is None else (ray_status, alive)
            summary = self.summary_of(record) if ray_status not in ("PENDING", "RUNNING", UNREACHABLE) else None
            outcome = (summary or {}).get("status") if record.kind == "job" else None
            state, action = reconcile_decision(record.state, ray_status, outcome, others_alive,
                                               self.stop_overdue(record, time.time()))
            if action == "wait":
                self._failed(record_id, "status", f"Ray's Jobs API did not answer for {sid} ({self._last_ray_error}); "
                                        "the record is kept as it is")
                return self.store.get(record_id)
            if summary is not None:
                record.summary = summary
            if action == "send":
                return self._send(record, reason="submitted to Ray")
            if action == "resubmit":
                self._failures.pop(record_id, None)
                return self.submit(record, reason="Ray lost the job (head restarted?): resubmitted from its checkpoint")
            if action == "stop" and not self._ray_stop(record_id, sid):
                return self.store.get(record_id)
            self._recovered(record)
            if record.move(state, f"Ray says {ray_status}") or summary is not None:
                self.store.save(record)
            return record

    def reconcile_all(self) -> bool:
        """One pass over the unfinished records; False when it failed (said in the log, retried next pass).

        Each record is guarded on its own, so one that fails never starves the others, and the
        whole pass is guarded, so the reconciler thread outlives anything a pass meets.
        """
        ok = True
        try:
            now = time.monotonic()
            for record in self.store.all():
                if record.state in TERMINAL or self._failures.get(record.id, (0, 0.0))[1] > now:
                    continue
                try:
                    self.reconcile_one(record.id)
                except Exception as exc:  # boundary: one record's failure is retried, the rest go on
                    ok = False
                    self._failed(record.id, "reconcile", f"reconcile failed: {type(exc).__name__}: {str(exc)[:300]}")
            if self.on_reconciled:
                self.on_reconciled(self.store.all())
        except Exception as exc:  # boundary: the store itself failed; the next pass retries
            print(f"[etrain-service] reconcile pass failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            if self.on_reconcile_error:
                self.on_reconcile_error("pass")
            return False
        return ok

    def run_reconciler(self, stop: threading.Event) -> None:
        """Reconcile at once, then every interval, until ``stop``; no error ends the loop."""
        while True:
            self.reconcile_all()
            if stop.wait(self.settings.reconcile_interval_s):
                return


    # ------------------------------------------------------------ what a tenant is shown

    def relative(self, tenant: str, text: str) -> str:
        """Locations in ``text`` relative to the tenant's storage prefix (others' to the root):
        answers never show where the server keeps things."""
        return text.replace(self.tenant_root(tenant).uri + "/", "").replace(self.root.uri + "/", "")

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
