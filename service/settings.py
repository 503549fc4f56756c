"""How the service runs (ServiceSettings), as `etrain serve` fills it from flags, a --config file and
the environment; checked once at start-up, so a wrong value stops the service with its field named."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from service.auth import ROLES, is_under
from service.limits import DEFAULT_ROLE_LIMITS, RoleLimits
from trainers.api import REF_PATTERN

STATE_DIR_ENV = "ETRAIN_STATE_DIR"
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
        bad = [r for r in refs if not re.fullmatch(REF_PATTERN, r)]
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
