"""service.limits: per-role maxima on what one job asks for, and the tenant's CPU/GPU quota."""

from __future__ import annotations

import pytest

from service.limits import (DEFAULT_ROLE_LIMITS, Footprint, RoleLimits, job_footprint, limit_problems, quota_problem,
                            sweep_footprint)
from trainers.config import validate

USER = DEFAULT_ROLE_LIMITS["user"]


@pytest.mark.parametrize("spec, expected", [
    ({}, []),
    ({"distributed": {"num_workers": {"min": 1, "max": 64}}},
     ["distributed.num_workers: 64: over role 'user''s maximum of 16: ask for fewer workers"]),
    ({"distributed": {"num_workers": 2, "resources_per_worker": {"GPU": 8}}},
     ["distributed.resources_per_worker.GPU: 8.0: over role 'user''s maximum of 1.0"]),
    ({"distributed": {"resources_per_worker": {"CPU": 64, "accelerator_type:H100": 4}}},
     ["distributed.resources_per_worker.CPU: 64.0: over role 'user''s maximum of 16.0",
      "distributed.resources_per_worker.accelerator_type:H100: 4.0: over role 'user''s maximum of 1.0"]),
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


def test_a_sweep_holds_its_largest_trial_times_its_concurrency():
    small, big = validate({"distributed": {"num_workers": 1, "use_gpu": False}}), validate(
        {"distributed": {"num_workers": 3, "use_gpu": False}})
    assert sweep_footprint([small, big], 4) == Footprint(12, 0)


def test_the_quota_counts_cpus_and_gpus_beside_what_is_held():
    assert quota_problem("t", Footprint(60, 0), Footprint(4, 0), 64, 16) is None
    cpu = quota_problem("t", Footprint(60, 0), Footprint(8, 0), 64, 16)
    assert cpu.startswith("tenant 't' holds 60 of its quota of 64 CPUs and this asks for 8")
    gpu = quota_problem("t", Footprint(0, 0), Footprint(128, 512), 1e9, 16)
    assert gpu.startswith("tenant 't' holds 0 of its quota of 16 GPUs and this asks for 512")
    assert "use_gpu: false for CPU work" in gpu
