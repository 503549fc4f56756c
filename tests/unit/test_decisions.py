"""Small pure decisions: learning-rate schedule, runtime resolution, storage URIs."""

from __future__ import annotations

import math

import pytest

from cluster.storage import check_uri, open_root
from trainers.config.errors import SpecError
from trainers.config.loading import validate
from trainers.home import job_home
from trainers.launch import reached_max_steps, resolve_runtime
from trainers.trainer import lr_factor, step_seed


@pytest.mark.parametrize("step,expected", [(0, 0.1), (9, 1.0), (10, 1.0), (55, 0.55), (100, 0.1)])
def test_warmup_cosine(step, expected):
    assert math.isclose(lr_factor(step, 100, 10, 0.1, "warmup_cosine"), expected, abs_tol=1e-9)


def test_constant_schedule():
    assert lr_factor(50, 100, 10, 0.1, "constant") == 1.0


def test_step_seeds_differ_by_rank_and_step():
    seeds = {step_seed(0, s, r) for s in range(100) for r in range(8)}
    assert len(seeds) == 800


@pytest.mark.parametrize("dist,precision,gpus,use_gpu,backend,note", [
    ({"backend": "nccl"}, "none", 0, False, "gloo", "falling back to gloo"),
    ({"backend": "auto"}, "none", 0, False, "gloo", None),
    ({"backend": "auto"}, "bf16", 8, True, "nccl", None),
    ({"backend": "gloo", "use_gpu": True}, "none", 1, True, "gloo", None),
    ({"master_addr": "10.0.0.1", "master_port": 29500}, "none", 0, False, "gloo", "Ray's rendezvous"),
])
def test_resolve_runtime(dist, precision, gpus, use_gpu, backend, note):
    spec = validate({"distributed": dist, "training": {"mixed_precision": precision}})
    rt = resolve_runtime(spec, gpus)
    assert (rt.use_gpu, rt.backend, rt.mixed_precision) == (use_gpu, backend, precision)
    assert (note is None and not rt.notes) or any(note in n for n in rt.notes)


@pytest.mark.parametrize("dist,gpus_now,launchable,use_gpu,backend,note", [
    # GPU node types that scale from zero: a default job asks for GPUs, so one launches.
    ({}, 0, 8, True, "nccl", "the autoscaler launches them"),
    ({"use_gpu": True}, 0, 2, True, "nccl", "the autoscaler launches them"),
    ({}, 2, 8, True, "nccl", None),
    # CPU-only cluster (no GPU type): stays on CPU with gloo.
    ({}, 0, 0, False, "gloo", None),
    ({"use_gpu": False}, 0, 8, False, "gloo", None),
])
def test_use_gpu_auto_counts_gpus_the_autoscaler_can_launch(dist, gpus_now, launchable, use_gpu, backend, note):
    rt = resolve_runtime(validate({"distributed": dist}), gpus_now, launchable)
    assert (rt.use_gpu, rt.backend) == (use_gpu, backend)
    assert (note is None and not rt.notes) or any(note in n for n in rt.notes)


@pytest.mark.parametrize("dist,precision,message", [
    ({"use_gpu": True}, "none", "distributed.use_gpu: true: the cluster has no GPUs and no GPU node type to launch"),
    ({}, "fp16", "training.mixed_precision: fp16: needs a GPU"),
])
def test_runtime_refusals_name_the_field(dist, precision, message):
    spec = validate({"distributed": dist, "training": {"mixed_precision": precision}})
    with pytest.raises(SpecError) as info:
        resolve_runtime(spec, 0)
    assert message in info.value.problems[0]


@pytest.mark.parametrize("uri,ok", [("/tmp/x", True), ("file:///tmp/x", True), ("s3://bucket/p", True),
                                    ("s3://b", False), ("gs://b/x", False), ("", False)])
def test_check_uri(uri, ok):
    assert (check_uri(uri) is None) == ok


def test_local_root_roundtrip_and_run_paths(tmp_path):
    root = open_root(str(tmp_path / "r"))
    root.write_json({"a": 1}, "job", "summary.json")
    assert root.read_json("job", "summary.json") == {"a": 1}
    assert root.list_dirs() == ["job"]
    spec = validate({"name": "j", "checkpoint": {"path": "ckpts/nested/model_{step}.pt", "storage_root": str(tmp_path)}})
    home = job_home(spec)
    assert home.ray_paths() == (f"{tmp_path}/j/ckpts", "nested") and home.uri == f"{tmp_path}/j"


@pytest.mark.parametrize("path,job_folder,run_path", [
    ("/checkpoints/model_{step}.pt", "/checkpoints", "/checkpoints"),
    ("/mnt/shared/runs/a/model_{step}.pt", "/mnt/shared/runs/a", "/mnt/shared/runs/a"),
    ("checkpoints/model_{step}.pt", "{root}/j", "{root}/j/checkpoints"),
    ("model_{step}.pt", "{root}/j", "{root}/j/checkpoints"),
])
def test_an_absolute_checkpoint_path_is_the_jobs_folder(tmp_path, path, job_folder, run_path):
    home = job_home(validate({"name": "j", "checkpoint": {"path": path, "storage_root": str(tmp_path)}}))
    assert home.uri == job_folder.format(root=tmp_path) and home.run_path == run_path.format(root=tmp_path)


def test_two_jobs_of_one_name_in_two_roots_have_two_keys(tmp_path):
    a, b = (job_home(validate({"name": "quickstart", "checkpoint": {"storage_root": str(tmp_path / r)}}))
            for r in ("a", "b"))
    assert a.key != b.key and a.key.startswith("etrain/quickstart-")


def test_missing_user_data_is_refused_before_ray(tmp_path):
    from trainers.launch import preflight

    spec = validate({"model": {"factory": "userpkg:make_model"}, "data": {"source": str(tmp_path / "train.parquet")},
                     "checkpoint": {"storage_root": str(tmp_path / "root")}})
    with pytest.raises(SpecError) as info:
        preflight(spec)
    assert info.value.problems[0].startswith(f"data.source: '{tmp_path}/train.parquet': not found")


@pytest.mark.parametrize("metrics,max_steps,done", [
    ({"step": 12, "target_step": 12}, 12, True),
    ({"step": 12, "target_step": 12}, 20, False),  # max_steps raised: train on
    ({"step": 6, "target_step": 12}, 12, False),  # stopped early
    ({"step": 30, "target_step": 30}, 12, False),  # lowered: the loop decides (it checkpoints where it is)
    ({}, 12, False),  # no verified checkpoint
    ({"step": 12}, 12, False),  # a manifest without a target (an older format): run the loop
])
def test_a_rerun_starts_no_workers_only_when_the_newest_checkpoint_is_at_max_steps(metrics, max_steps, done):
    assert reached_max_steps(metrics, max_steps) is done
