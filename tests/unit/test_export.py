"""`etrain export` (trainers/export.py): a job's model weights out of its newest or a given verified
checkpoint, into its folder, loadable by safetensors, torch.load and another job's model.init_from."""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest
import torch

from trainers import checkpoint_files as ckpt
from trainers.cli import main
from trainers.config.loading import validate
from trainers.export import ExportError, export_weights, unshared
from trainers.init_weights import load_into
from trainers.job_folder import job_home
from trainers.workloads import resolve


def spec_in(root, **model):
    return validate({"name": "trained", "model": {"hidden_size": 16, **model},
                     "checkpoint": {"storage_root": str(root)}})


def weights_at(step: int, spec) -> dict:
    torch.manual_seed(step)
    return resolve(spec).build_model(spec).state_dict()


def write_job(spec, steps: list[int]) -> None:
    """Checkpoints as the loop writes them (model, optimizer, step...) at these steps."""
    home = job_home(spec)
    for step in steps:
        ckpt.write(pafs.LocalFileSystem(), f"{home.run_path}/{ckpt.dir_name(step)}",
                   {"step": step, "model": weights_at(step, spec), "optimizer": {"state": {}}, "cursor": {}},
                   spec.checkpoint.file_name(step))


def test_the_newest_verified_checkpoint_is_exported_as_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    spec = spec_in(tmp_path)
    write_job(spec, [4, 8, 12])
    torn = job_home(spec).run_path + f"/{ckpt.dir_name(12)}/{spec.checkpoint.file_name(12)}"
    with open(torn, "r+b") as f:
        f.truncate(10)  # the newest was never completed: the one before is exported
    uri = export_weights(spec)
    assert uri == str(tmp_path / "trained" / "exported" / "model.safetensors")
    exported = load_file(uri)
    for key, value in weights_at(8, spec).items():
        assert torch.equal(exported[key], value), key
    with safe_open(uri, "pt") as f:
        assert f.metadata() == {"job": "trained", "step": "8", "checkpoint": ckpt.dir_name(8)}
    model = resolve(spec).build_model(spec)
    load_into(model, uri)  # what another job's model.init_from takes
    assert torch.equal(model.state_dict()["0.weight"], weights_at(8, spec)["0.weight"])


def test_a_given_step_as_a_torch_file_from_the_command_line(tmp_path, capsys):
    spec = spec_in(tmp_path)
    write_job(spec, [4, 8])
    (tmp_path / "spec.yaml").write_text(f"name: trained\nmodel: {{hidden_size: 16}}\n"
                                        f"checkpoint: {{storage_root: {tmp_path}}}\n")
    assert main(["export", str(tmp_path / "spec.yaml"), "--step", "4", "--format", "pt"]) == 0
    uri = capsys.readouterr().out.strip()
    assert uri == str(tmp_path / "trained" / "exported" / "model.pt")
    exported = torch.load(uri, weights_only=True)
    assert set(exported) == set(weights_at(4, spec))
    assert all(torch.equal(exported[k], v) for k, v in weights_at(4, spec).items())


def test_no_checkpoint_is_a_clear_error(tmp_path, capsys):
    spec = spec_in(tmp_path)
    with pytest.raises(ExportError) as info:
        export_weights(spec)
    assert str(info.value) == (f"job 'trained': no verified checkpoint in {tmp_path}/trained/checkpoints: run the "
                               "job first (etrain run SPEC), or check the spec's name and checkpoint.storage_root")
    (tmp_path / "spec.yaml").write_text(f"name: trained\ncheckpoint: {{storage_root: {tmp_path}}}\n")
    assert main(["export", str(tmp_path / "spec.yaml")]) == 1
    assert capsys.readouterr().err.startswith("[etrain] error: job 'trained': no verified checkpoint in ")


def test_a_step_without_a_good_checkpoint_names_the_steps_there_are(tmp_path):
    spec = spec_in(tmp_path)
    write_job(spec, [4, 8])
    with pytest.raises(ExportError) as info:
        export_weights(spec, step=6)
    assert str(info.value) == (f"--step 6: job 'trained' has no checkpoint at that step in {tmp_path}/trained/"
                               "checkpoints (steps with one: 4, 8): pick one of them, or leave --step out for the newest")
    (tmp_path / "trained" / "checkpoints" / ckpt.dir_name(8) / ckpt.MANIFEST).unlink()
    with pytest.raises(ExportError, match=r"--step 8: the checkpoint does not verify \(no manifest.json .*\): pick "
                                          "another step"):
        export_weights(spec, step=8)


def test_tied_weights_are_written_apart_and_load_back_tied():
    shared = torch.randn(4, 3)
    out = unshared({"embed.weight": shared, "head.weight": shared, "other": torch.randn(2).expand(3, 2)})
    assert out["embed.weight"].data_ptr() != out["head.weight"].data_ptr()
    assert torch.equal(out["embed.weight"], out["head.weight"]) and out["other"].is_contiguous()


def test_exporting_to_s3_writes_into_the_jobs_folder_there(s3_server, tmp_path):
    import boto3
    from safetensors.torch import load

    boto3.client("s3").create_bucket(Bucket="export-runs")
    spec = validate({"name": "trained", "model": {"hidden_size": 16},
                     "checkpoint": {"storage_root": "s3://export-runs/runs"}})
    home = job_home(spec)
    ckpt.write(home.root.fs, f"{home.run_path}/{ckpt.dir_name(3)}",
               {"step": 3, "model": weights_at(3, spec)}, spec.checkpoint.file_name(3))
    uri = export_weights(spec)
    assert uri == "s3://export-runs/runs/trained/exported/model.safetensors"
    body = boto3.client("s3").get_object(Bucket="export-runs", Key="runs/trained/exported/model.safetensors")["Body"]
    assert torch.equal(load(body.read())["3.weight"], weights_at(3, spec)["3.weight"])
