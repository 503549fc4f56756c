"""The launcher's decisions (trainers/launch.py): runtime resolution, refusals before Ray starts,
and when a rerun starts no workers."""

from __future__ import annotations

import pytest

from trainers.config.errors import SpecError
from trainers.config.loading import validate
from trainers.launch import reached_max_steps, resolve_runtime


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


def test_missing_user_data_is_refused_before_ray(tmp_path):
    from trainers.launch import preflight

    spec = validate({"model": {"factory": "userpkg:make_model"}, "data": {"source": str(tmp_path / "train.parquet")},
                     "checkpoint": {"storage_root": str(tmp_path / "root")}})
    with pytest.raises(SpecError) as info:
        preflight(spec)
    assert info.value.problems[0].startswith(f"data.source: '{tmp_path}/train.parquet': not found")


def test_missing_pretrained_weights_are_refused_before_ray(tmp_path):
    from trainers.launch import preflight

    spec = validate({"model": {"init_from": str(tmp_path / "w.safetensors")},
                     "checkpoint": {"storage_root": str(tmp_path / "root")}})
    with pytest.raises(SpecError) as info:
        preflight(spec)
    assert info.value.problems == [f"model.init_from: '{tmp_path}/w.safetensors': not found: check the path or the "
                                   "bucket (a relative path is read from the directory you launch in)"]


def test_relative_pretrained_weights_reach_the_workers_as_an_absolute_path(tmp_path, monkeypatch):
    from trainers.launch import with_absolute_paths

    monkeypatch.chdir(tmp_path)
    spec = validate({"model": {"init_from": "weights/w.pt"}})
    assert with_absolute_paths(spec).model.init_from == str(tmp_path / "weights" / "w.pt")
    assert spec.model.init_from == "weights/w.pt", "the caller's spec is left as it was"
    on_s3 = validate({"model": {"init_from": "s3://models/w.pt"}})
    assert with_absolute_paths(on_s3) is on_s3


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
