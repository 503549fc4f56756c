"""Submitting jobs and sweeps as Ray Jobs: check a spec against the tenant's role and quota, store
it, and hand each attempt to Ray; resume a stopped or failed one under today's rules.

Each record runs as Ray Jobs submissions whose entrypoint is a fixed argument list
(``<python> -m trainers.train <spec URI>``); user text never reaches a shell, and what code
a spec may name is the tenant's role's to say (service.auth). The submission id is
``etrain-<record id>-<attempt>``, so a submission repeated after a crash is refused by Ray
instead of running twice; an Idempotency-Key does the same for a repeated request.

A job gets its tenant's prefix of the storage root and a scrubbed environment (the
service's secrets and cloud keys blanked, the tenant's own variables added); the service's
state (service.store) is in a folder no job is told of.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import shlex
import time
from dataclasses import dataclass

from cluster.signed_fs import KEY_ENV as STATE_KEY_ENV
from cluster.signed_fs import new_key
from service.auth import Principal, in_tenant_data, policy_problems
from service.context import JobsContext
from service.limits import Footprint, job_footprint, limit_problems_of, quota_problem, sweep_footprint
from service.ray_failures import submission_retryable
from service.states import ACTIVE, RESUMABLE, JobState
from service.store import Record, new_id
from trainers import api as trainers
from trainers.api import NAME_PATTERN, SpecError

ENTRY_MODULES = {"job": "trainers.train", "sweep": "trainers.sweep"}
# Variables of the service's own environment that no job gets (they are blanked in its runtime_env):
# cloud credentials, tokens, passwords, and where the service keeps its state.
SECRET_ENV = re.compile(r"^(AWS_(ACCESS_KEY_ID|SECRET_ACCESS_KEY|SESSION_TOKEN|SECURITY_TOKEN|PROFILE|"
                        r"SHARED_CREDENTIALS_FILE|CONFIG_FILE|WEB_IDENTITY_TOKEN_FILE|ROLE_ARN|CONTAINER_\w+)|"
                        r"ETRAIN_TOKENS?|ETRAIN_STATE_DIR|GRAFANA_TOKEN|(?!RAY_)\w*(SECRET|PASSWORD|PASSWD|PRIVATE_KEY|"
                        r"CREDENTIALS?|API_KEY|_TOKEN)\w*)$")


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


class Conflict(Exception):
    pass


class Submitter:
    """Check, store and submit records; resume them. Changes to records are made under the context's lock."""

    def __init__(self, context: JobsContext):
        self.context = context

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
        settings, tenant, troot = self.context.settings, who.tenant, self.context.tenant_root(who.tenant)
        problems = policy_problems(who.role, data, settings.allowed_factories, troot.uri,
                                   settings.tenant_data_uris.get(tenant, []))
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
        limits = settings.role_limits[who.role]
        if kind == "sweep":
            sweep = run.get("sweep")
            if isinstance(sweep, dict) and sweep.get("base"):
                raise SpecError([f"sweep.base: {sweep['base']!r}: not available over HTTP: put the job spec's "
                                 "sections in the same body"])
            plan = trainers.check_sweep(run)
            trials, cap = sweep_trials(plan.sweep), settings.max_sweep_trials.get(who.role, 0)
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
        for name_of_section, key in (("data", "source"), ("model", "init_from")):
            section = run.get(name_of_section)
            if isinstance(section, dict) and isinstance(section.get(key), str):
                run[name_of_section] = dict(section, **{key: in_tenant_data(section[key], troot.uri)})
        return Checked(name, run, slots, footprint)

    def limits_of_record(self, record: Record, role: str) -> list[str]:
        """What a stored record asks for over ``role``'s maxima of today (every trial of a sweep)."""
        if record.kind == "sweep":
            specs = trainers.trial_specs(trainers.check_sweep(record.spec))
        else:
            specs = [trainers.check_job(record.spec)]
        return limit_problems_of(role, specs, self.context.settings.role_limits[role])

    def quota(self, tenant: str) -> int:
        settings = self.context.settings
        return settings.tenant_quotas.get(tenant, settings.max_active_per_tenant)

    def active_slots(self, tenant: str) -> int:
        return sum(r.slots for r in self.context.store.all() if r.tenant == tenant and r.state in ACTIVE)

    def held(self, tenant: str) -> Footprint:
        active = [r for r in self.context.store.all() if r.tenant == tenant and r.state in ACTIVE]
        return Footprint(cpus=sum(r.cpus for r in active), gpus=sum(r.gpus for r in active))

    def check_quota(self, tenant: str, slots: int, asked: Footprint) -> None:
        active, quota = self.active_slots(tenant), self.quota(tenant)
        if active + slots > quota:
            raise QuotaExceeded(f"tenant {tenant!r} holds {active} of its quota of {quota} slots (a job takes 1, a "
                                f"sweep its max_concurrent_trials) and this needs {slots}: wait for one to finish, "
                                "stop one, or lower max_concurrent_trials")
        s = self.context.settings
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
            with self.context.lock:
                bound = self.context.store.key_binding(tenant, idempotency_key)
                if bound:
                    return self._replay(bound, body_sha256), False
        # Outside the lock: checking a spec is the slow part of a submit, and other tenants' requests
        # need not wait for it. The quota, the key and the record are taken together under it.
        record_id = new_id(kind)
        checked = self.check_spec(kind, data, who, record_id)
        name, run, slots = checked.name, checked.run, checked.slots
        with self.context.lock:
            self.check_quota(tenant, slots, checked.footprint)
            if idempotency_key:
                bound = self.context.store.claim_key(tenant, idempotency_key, record_id, body_sha256)
                if bound["id"] != record_id:
                    return self._replay(bound, body_sha256), False
            troot = self.context.tenant_root(tenant)
            if kind == "job":  # goodput counts from here, queueing included
                troot.write_json({"submitted_at": time.time()}, record_id, trainers.JOB_FILE)
            now = time.time()
            record = Record(id=record_id, kind=kind, tenant=tenant, name=name, spec=run,
                            spec_uri=self.context.specs_root(tenant).uri_of(f"{record_id}.json"),  # written by submit
                            storage=troot.uri_of(self.run_folder_for(kind, record_id)), slots=slots,
                            cpus=checked.footprint.cpus, gpus=checked.footprint.gpus,
                            state_key=new_key() if kind == "sweep" else None,
                            created_at=now, updated_at=now)
            record.move(JobState.PENDING, "submitted")
            self.context.store.save(record)
        # Outside the lock: Ray's HTTP call need not serialise submits. A racing retry of the same
        # key submits the same submission id, which Ray refuses: still one job.
        return self.submit(record), True

    @staticmethod
    def run_folder_for(kind: str, record_id: str) -> str:
        return f"sweeps/{record_id}" if kind == "sweep" else record_id

    def _replay(self, bound: dict, body_sha256: str) -> Record:
        if bound.get("body_sha256") != body_sha256:
            raise Conflict("this Idempotency-Key was used with a different body: use a new key for a new job")
        record = self.context.store.get(bound["id"])
        if record is None:
            raise Conflict("this Idempotency-Key's first request did not finish storing its job: retry with a new key")
        if not record.submissions:
            record = self.submit(record)
        return record

    def entrypoint(self, record: Record, resume: bool) -> str:
        args = [self.context.settings.python, "-m", ENTRY_MODULES[record.kind], record.spec_uri, "--spec-sha256",
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
        env["ETRAIN_STORAGE_ROOT"] = self.context.tenant_root(record.tenant).uri
        env.update(self.context.settings.tenant_env.get(record.tenant, {}))
        env[STATE_KEY_ENV] = record.state_key or ""
        return env

    def store_spec(self, tenant: str, record_id: str, spec: dict) -> tuple[str, str]:
        """Write the spec the service checked where the tenant's keys do not write; (its URI, its SHA-256)."""
        data = json.dumps(spec, indent=2, sort_keys=True).encode()
        specs = self.context.specs_root(tenant)
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
        self.context.store.save(record)
        return self.send(record, reason)

    def send(self, record: Record, reason: str) -> Record:
        """Hand the record's latest submission to Ray. Ray's "try again later" (no job agent yet,
        a 502/503/504, no answer) leaves the record PENDING under back-off: the reconciler sends
        the same submission id again, so Ray runs it once. Any other refusal fails the record."""
        sid, store = record.submissions[-1], self.context.store
        try:
            self.context.client.submit_job(entrypoint=self.entrypoint(record, resume=len(record.submissions) > 1),
                                           submission_id=sid,
                                           metadata={"etrain_record": record.id, "tenant": record.tenant},
                                           runtime_env={"env_vars": self.job_env(record)},
                                           entrypoint_resources=self.context.settings.entrypoint_resources or None)
        except Exception as exc:  # boundary: Ray's HTTP API
            if "already exists" not in str(exc):  # Ray has it: a retry of a submission it took
                if submission_retryable(exc):
                    if record.move(JobState.PENDING, "waiting for Ray's Jobs API"):
                        store.save(record)
                    self.context.failures.failed(record.id, "submit", f"Ray did not take submission {sid} yet ("
                                                 f"{type(exc).__name__}: {str(exc)[:200]}); the service sends it again")
                    return store.get(record.id)
                record.error = f"Ray refused the submission: {exc}"
                record.move(JobState.FAILED, "submission refused")
                store.save(record)
                return record
        self.context.failures.forget(record.id)
        record.error = None
        record.move(JobState.RUNNING, reason)
        store.save(record)
        return record

    def resume(self, record: Record, who: Principal) -> Record:
        """Start the next attempt of a stopped or failed record, under today's rules for the one who
        asks: an allow-list or a role changed since the submit applies to the resume too."""
        settings = self.context.settings
        with self.context.lock:
            record = self.context.store.get(record.id)
            if record.state not in RESUMABLE:
                raise Conflict(f"{record.kind} {record.id} is {record.state}: only a {JobState.STOPPED} or "
                               f"{JobState.FAILED} one resumes")
            problems = policy_problems(who.role, record.spec, settings.allowed_factories,
                                       self.context.tenant_root(record.tenant).uri,
                                       settings.tenant_data_uris.get(record.tenant, []))
            if not problems:
                problems = self.limits_of_record(record, who.role)
            if problems:
                raise Forbidden(problems)
            self.check_quota(record.tenant, record.slots, Footprint(record.cpus, record.gpus))
            return self.submit(record, reason="resumed")
