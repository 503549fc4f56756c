"""service.limits: per-role maxima on what one job asks for, and the tenant's CPU/GPU quota."""

from __future__ import annotations

import pytest

from service.limits import (DEFAULT_ROLE_LIMITS, Footprint, RoleLimits, job_footprint, limit_problems, quota_problem,
                            sweep_footprint)
from trainers.config.loading import validate

USER = DEFAULT_ROLE_LIMITS["user"]


@pytest.mark.parametrize("spec, expected", [
    ({}, []),
    ({"distributed": {"num_workers": {"min": 1, "max": 64}}},
     ["distributed.num_workers: 64: over role 'user''s maximum of 16: ask for fewer workers"]),
    ({"distributed": {"num_workers": 2, "resources_per_worker": {"GPU": 8}}},
     ["distributed.resources_per_worker.GPU: 8.0: over role 'user''s maximum of 1.0"]),
    ({"distributed": {"resources_per_worker": {"CPU": 64}}},
     ["distributed.resources_per_worker.CPU: 64.0: over role 'user''s maximum of 16.0"]),
    ({"fault_tolerance": {"worker_start_timeout_s": 1e300}, "distributed": {"resize_check_interval_s": 1e9}},
     ["fault_tolerance.worker_start_timeout_s: 1e+300: over", "distributed.resize_check_interval_s: 1000000000.0"]),
    ({"checkpoint": {"num_to_keep": None}}, ["checkpoint.num_to_keep: null: over role 'user''s maximum of 20"]),
    ({"data": {"num_workers": 64, "prefetch_factor": 1000, "shuffle_window_row_groups": 100000}},
     ["data.num_workers: 64: over", "data.prefetch_factor: 1000: over", "data.shuffle_window_row_groups: 100000: over"]),
    ({"model": {"name": "tiny_gpt", "d_model": 65536, "n_heads": 4, "n_layers": 1000, "max_seq_len": 1 << 20},
      "data": {"source": "builtin:text"}},
     ["model.d_model: 65536: over", "model.n_layers: 1000: over", "model.max_seq_len: 1048576: over"]),
    ({"training": {"max_steps": 10**12}}, ["training.max_steps: 1000000000000: over role 'user''s maximum"]),
    ({"fault_tolerance": {"max_failures": -1}},
     ["fault_tolerance.max_failures: -1: over role 'user''s maximum of 20: ask for a bounded number of retries"]),
    ({"fault_tolerance": {"max_failures": 20}}, []),
])
def test_a_user_job_over_a_maximum_names_the_field_value_and_limit(spec, expected):
    problems = limit_problems("user", validate(spec), USER)
    assert len(problems) == len(expected), problems
    for line, start in zip(problems, expected):
        assert line.startswith(start) and "(your operator sets role_limits)" in line, (line, start)


def test_a_user_worker_asks_for_cpu_and_gpu_only():
    """A custom resource could pin a node ('node:<ip>') or hold the head's own resource, which job
    drivers wait for: refused for a user, counted for nobody."""
    spec = validate({"distributed": {"resources_per_worker": {"CPU": 0.001, "head": 1, "node:10.0.0.1": 1}}})
    problems = limit_problems("user", spec, USER)
    assert problems == [f"distributed.resources_per_worker.{r}: not allowed for role 'user': workers ask for CPU and "
                        "GPU only (a custom resource could pin nodes or hold what the cluster keeps for job drivers)"
                        for r in ("head", "node:10.0.0.1")], problems
    assert limit_problems("code", spec, DEFAULT_ROLE_LIMITS["code"]) == []
    assert job_footprint(spec).cpus == 2  # a thousandth of a CPU still runs a process a worker: 1 each


def test_admin_has_no_maximum_and_an_operator_sets_its_own():
    huge = validate({"training": {"batch_size": 4096}, "distributed": {"num_workers": 512, "resources_per_worker": {"GPU": 8}},
                     "fault_tolerance": {"max_failures": -1}})
    assert limit_problems("admin", huge, DEFAULT_ROLE_LIMITS["admin"]) == []
    assert limit_problems("code", huge, RoleLimits(max_workers=600)) == []


@pytest.mark.parametrize("distributed, cpus, gpus", [
    ({"num_workers": 2}, 2, 2),  # use_gpu left to the cluster: a worker may take a GPU
    ({"num_workers": 2, "use_gpu": False}, 2, 0),
    ({"num_workers": {"min": 1, "max": 4}, "use_gpu": True, "resources_per_worker": {"CPU": 4, "GPU": 2}}, 16, 8),
])
def test_a_jobs_footprint_is_every_worker_at_the_top_of_its_range(distributed, cpus, gpus):
    assert job_footprint(validate({"distributed": distributed})) == Footprint(cpus, gpus)


def test_a_sweep_holds_the_worst_of_each_field_times_its_concurrency():
    """Values of two keys combine in one trial: 16 workers from one key's list and 16 CPUs a worker from
    another's make a 256-CPU trial that no single listed value shows."""
    many = validate({"training": {"batch_size": 64}, "distributed": {"num_workers": 16, "use_gpu": False}})
    wide = validate({"distributed": {"num_workers": 1, "use_gpu": False, "resources_per_worker": {"CPU": 16}}})
    gpu = validate({"distributed": {"num_workers": 1, "use_gpu": True}})
    assert sweep_footprint([many, wide], 4) == Footprint(4 * 16 * 16, 0)
    assert sweep_footprint([many, gpu], 4) == Footprint(4 * 16, 4 * 16)


def test_the_quota_counts_cpus_and_gpus_beside_what_is_held():
    assert quota_problem("t", Footprint(60, 0), Footprint(4, 0), 64, 16) is None
    cpu = quota_problem("t", Footprint(60, 0), Footprint(8, 0), 64, 16)
    assert cpu.startswith("tenant 't' holds 60 of its quota of 64 CPUs and this asks for 8")
    gpu = quota_problem("t", Footprint(0, 0), Footprint(128, 512), 1e9, 16)
    assert gpu.startswith("tenant 't' holds 0 of its quota of 16 GPUs and this asks for 512")
    assert "use_gpu: false for CPU work" in gpu
