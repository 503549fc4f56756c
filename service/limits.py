"""What one job may cost, per role, and what a tenant may hold at once, in CPUs and GPUs.

Every field of a spec that buys CPU, memory, GPUs, processes or time has a per-role maximum
(``RoleLimits``; the operator sets them in ``role_limits``); a spec over one is refused (403)
with the field, its value and the limit. A tenant's unfinished jobs and sweeps together hold at
most its CPU and GPU quota (429), counted as the most the autoscaler could be asked for: every
worker at the top of its range, each trial of a sweep that may run at once.

Pure functions over a validated spec: the service calls them, tests table-drive them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class RoleLimits(BaseModel):
    """The most one job of a role may ask for; None: no limit."""

    model_config = ConfigDict(extra="forbid")

    max_workers: int | None = Field(None, gt=0, description="distributed.num_workers (the top of a range)")
    max_cpus_per_worker: float | None = Field(None, gt=0, description="distributed.resources_per_worker.CPU")
    max_gpus_per_worker: float | None = Field(None, ge=0, description="distributed.resources_per_worker.GPU")
    custom_resources: bool = Field(
        True, description="whether distributed.resources_per_worker may name resources besides CPU and GPU (a "
                          "'node:<ip>' pin, the head's own resource that job drivers wait for, ...)")
    max_loader_workers: int | None = Field(None, ge=0, description="data.num_workers (loader processes per worker)")
    max_prefetch_factor: int | None = Field(None, gt=0, description="data.prefetch_factor")
    max_shuffle_window_row_groups: int | None = Field(None, gt=0, description="data.shuffle_window_row_groups")
    max_tokens_per_batch: int | None = Field(None, gt=0, description="data.max_tokens_per_batch")
    max_batch_size: int | None = Field(None, gt=0, description="training.batch_size (the global batch)")
    max_steps: int | None = Field(None, gt=0, description="training.max_steps; a job without it trains epochs")
    max_epochs: int | None = Field(None, gt=0, description="training.epochs")
    max_model_width: int | None = Field(None, gt=0, description="model.hidden_size and model.d_model")
    max_model_layers: int | None = Field(None, gt=0, description="model.n_layers")
    max_heads: int | None = Field(None, gt=0, description="model.n_heads")
    max_seq_len: int | None = Field(None, gt=0, description="model.max_seq_len")
    max_failures: int | None = Field(None, ge=0, description="fault_tolerance.max_failures (-1, unlimited, is over "
                                                             "any limit)")
    max_timeout_s: int | None = Field(None, gt=0, description="distributed.timeout_s")
    max_profile_steps: int | None = Field(None, gt=0, description="training.profile.num_steps")
    max_wait_s: float | None = Field(
        None, gt=0, description="fault_tolerance.worker_start_timeout_s, distributed.resize_check_interval_s and "
                                "resize_checkpoint_timeout_s")
    max_checkpoints_kept: int | None = Field(None, gt=0, description="checkpoint.num_to_keep (null, all, is over "
                                                                     "any limit)")


# A `user` runs built-in work on shared hardware: bounds a real fine-tune fits in, far below what
# would let one request ask the autoscaler for a fleet. `code` and `admin` are the operator's to bound.
DEFAULT_ROLE_LIMITS: dict[str, RoleLimits] = {
    "user": RoleLimits(max_workers=16, max_cpus_per_worker=16, max_gpus_per_worker=1,
                       custom_resources=False, max_wait_s=3600, max_checkpoints_kept=20,
                       max_loader_workers=8, max_prefetch_factor=8,
                       max_shuffle_window_row_groups=64, max_tokens_per_batch=1 << 20, max_batch_size=1 << 16,
                       max_steps=10_000_000, max_epochs=10_000, max_model_width=8192, max_model_layers=64,
                       max_heads=128, max_seq_len=32_768, max_failures=20, max_timeout_s=7200, max_profile_steps=100),
    "code": RoleLimits(max_workers=64, max_gpus_per_worker=8, max_failures=100),
    "admin": RoleLimits(),
}


def _get(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        data = getattr(data, part, None)
    return data


# (spec field, the RoleLimits field that bounds it, how a refusal names the fix)
BOUNDED_FIELDS = (
    ("distributed.max_workers", "max_workers", "fewer workers"),
    ("data.num_workers", "max_loader_workers", "fewer loader processes"),
    ("data.prefetch_factor", "max_prefetch_factor", "a smaller prefetch"),
    ("data.shuffle_window_row_groups", "max_shuffle_window_row_groups", "a smaller window"),
    ("data.max_tokens_per_batch", "max_tokens_per_batch", "a smaller budget"),
    ("training.batch_size", "max_batch_size", "a smaller global batch"),
    ("training.max_steps", "max_steps", "fewer steps"),
    ("training.epochs", "max_epochs", "fewer epochs"),
    ("model.hidden_size", "max_model_width", "a narrower model"),
    ("model.d_model", "max_model_width", "a narrower model"),
    ("model.n_layers", "max_model_layers", "fewer layers"),
    ("model.n_heads", "max_heads", "fewer heads"),
    ("model.max_seq_len", "max_seq_len", "shorter sequences"),
    ("distributed.timeout_s", "max_timeout_s", "a shorter timeout"),
    ("training.profile.num_steps", "max_profile_steps", "fewer traced steps"),
    ("fault_tolerance.worker_start_timeout_s", "max_wait_s", "a shorter wait"),
    ("distributed.resize_check_interval_s", "max_wait_s", "a shorter interval"),
    ("distributed.resize_checkpoint_timeout_s", "max_wait_s", "a shorter wait"),
)


def limit_problems(role: str, spec, limits: RoleLimits, where: str = "") -> list[str]:
    """Each field of ``spec`` (a validated JobSpec) over ``role``'s limits, as 'field: value: ...' lines."""
    problems = []

    def over(field: str, value: Any, limit: Any, fix: str) -> None:
        problems.append(f"{where}{field}: {value}: over role {role!r}'s maximum of {limit}: ask for {fix} (your "
                        "operator sets role_limits)")

    for field, name, fix in BOUNDED_FIELDS:
        value, limit = _get(spec, field), getattr(limits, name)
        shown = "distributed.num_workers" if field == "distributed.max_workers" else field
        if limit is not None and isinstance(value, (int, float)) and not isinstance(value, bool) and value > limit:
            over(shown, value, limit, fix)
    failures, limit = spec.fault_tolerance.max_failures, limits.max_failures
    if limit is not None and (failures == -1 or failures > limit):
        over("fault_tolerance.max_failures", failures, limit, "a bounded number of retries")
    kept, limit = spec.checkpoint.num_to_keep, limits.max_checkpoints_kept
    if limit is not None and (kept is None or kept > limit):
        over("checkpoint.num_to_keep", "null" if kept is None else kept, limit, "fewer checkpoints kept")
    for resource, amount in (spec.distributed.resources_per_worker or {}).items():
        if resource not in ("CPU", "GPU"):
            if not limits.custom_resources:
                problems.append(f"{where}distributed.resources_per_worker.{resource}: not allowed for role {role!r}: "
                                "workers ask for CPU and GPU only (a custom resource could pin nodes or hold what "
                                "the cluster keeps for job drivers)")
            continue
        limit = getattr(limits, "max_cpus_per_worker" if resource == "CPU" else "max_gpus_per_worker")
        if limit is not None and amount > limit:
            over(f"distributed.resources_per_worker.{resource}", amount, limit, "less per worker")
    return problems


def limit_problems_of(role: str, specs: list, limits: RoleLimits) -> list[str]:
    """Every problem of :func:`limit_problems` over several specs (a sweep's trials), each said once."""
    return list(dict.fromkeys(p for spec in specs for p in limit_problems(role, spec, limits)))


@dataclass(frozen=True)
class Footprint:
    """The most a job (or a sweep, all its concurrent trials) could ask the cluster for."""

    cpus: float
    gpus: float


def worker_footprint(spec) -> Footprint:
    """What one worker holds: at least 1 CPU (a worker's process runs whatever fraction it asks for),
    and one GPU when it may use GPUs (``use_gpu`` true or left to the cluster) unless it says how many."""
    d = spec.distributed
    per_worker = d.resources_per_worker or {}
    return Footprint(cpus=max(1.0, per_worker.get("CPU", 1.0)),
                     gpus=per_worker.get("GPU", 0.0 if d.use_gpu is False else 1.0))


def job_footprint(spec) -> Footprint:
    """Every worker at the top of its range."""
    worker = worker_footprint(spec)
    return Footprint(cpus=spec.distributed.max_workers * worker.cpus, gpus=spec.distributed.max_workers * worker.gpus)


def sweep_footprint(trial_specs: list, concurrent: int) -> Footprint:
    """``concurrent`` trials at the worst each field of the space allows, taken field by field: the most
    workers of any trial, times the most any trial's worker holds (values of two keys combine in a
    trial, so the largest listed trial alone may be smaller than a combination)."""
    workers = max(s.distributed.max_workers for s in trial_specs)
    per_worker = [worker_footprint(s) for s in trial_specs]
    return Footprint(cpus=concurrent * workers * max(p.cpus for p in per_worker),
                     gpus=concurrent * workers * max(p.gpus for p in per_worker))


def quota_problem(tenant: str, held: Footprint, asked: Footprint, cpu_quota: float, gpu_quota: float) -> str | None:
    """Why ``asked`` does not fit beside what ``tenant`` holds, or None."""
    for unit, have, want, quota in (("CPUs", held.cpus, asked.cpus, cpu_quota), ("GPUs", held.gpus, asked.gpus,
                                                                                 gpu_quota)):
        if have + want > quota:
            return (f"tenant {tenant!r} holds {have:g} of its quota of {quota:g} {unit} and this asks for {want:g} "
                    f"(every worker at the top of its range, each concurrent trial): wait for a job to finish, stop "
                    f"one, or ask for fewer workers{' (use_gpu: false for CPU work)' if unit == 'GPUs' else ''}")
    return None
