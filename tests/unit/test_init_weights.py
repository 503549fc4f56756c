"""Pretrained weights for step 0 (trainers/init_weights.py): every accepted format, from a real tiny
model's state dict, into a fresh model of the same shape; every refusal says the field, what is
wrong and the fix."""

from __future__ import annotations

import pytest
import torch

from trainers import checkpoint_files as ckpt
from trainers.config.loading import validate
from trainers.init_weights import InitFromError, check_exists, load_into, read_state_dict, strip_prefixes
from trainers.workloads import resolve


def digits_model(hidden: int = 16, seed: int = 0) -> torch.nn.Module:
    spec = validate({"model": {"hidden_size": hidden}})
    torch.manual_seed(seed)
    return resolve(spec).build_model(spec)


@pytest.fixture
def trained() -> dict[str, torch.Tensor]:
    """A real model's weights after a few optimizer steps: what a pretrained file holds."""
    model = digits_model(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_holds(model: torch.nn.Module, weights: dict) -> None:
    state = model.state_dict()
    assert set(state) == set(weights)
    for key, value in weights.items():
        assert torch.equal(state[key], value), key


def lightning_like(weights: dict) -> dict:
    """What Lightning's Trainer saves for a LightningModule holding the net as ``self.model``."""
    return {"epoch": 2, "global_step": 30, "pytorch-lightning_version": "2.5.0",
            "state_dict": {f"model.{k}": v for k, v in weights.items()},
            "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1, 2, 3]}]}],
            "lr_schedulers": [], "hyper_parameters": {"hidden": 16, "lr": 0.1}, "loops": {}}


@pytest.mark.parametrize("name,wrap", [
    ("plain.pt", lambda w: w),
    ("wrapped.pth", lambda w: {"state_dict": w, "epoch": 3}),
    ("under_model.bin", lambda w: {"model": w, "step": 7}),
    ("lightning.ckpt", lightning_like),
    ("ddp_saved.pt", lambda w: {f"module.{k}": v for k, v in w.items()}),
])
def test_each_pickle_format_starts_the_model_with_its_weights(tmp_path, trained, name, wrap):
    torch.save(wrap(trained), tmp_path / name)
    model = digits_model(seed=2)
    assert load_into(model, str(tmp_path / name)) == str(tmp_path / name)
    assert_holds(model, trained)


def test_safetensors_starts_the_model_with_its_weights(tmp_path, trained):
    from safetensors.torch import save_file

    save_file(trained, tmp_path / "w.safetensors")
    model = digits_model(seed=2)
    load_into(model, str(tmp_path / "w.safetensors"))
    assert_holds(model, trained)


def write_checkpoint(run: str, step: int, weights: dict) -> None:
    import pyarrow.fs as pafs

    ckpt.write(pafs.LocalFileSystem(), f"{run}/{ckpt.dir_name(step)}",
               {"step": step, "model": weights, "optimizer": {}}, f"model_{step}.pt")


def test_a_jobs_checkpoints_folder_gives_its_newest_verified_checkpoint(tmp_path, trained):
    run = str(tmp_path / "job" / "checkpoints")
    older = {k: torch.zeros_like(v) for k, v in trained.items()}
    write_checkpoint(run, 4, older)
    write_checkpoint(run, 8, trained)
    write_checkpoint(run, 12, older)
    (tmp_path / "job" / "checkpoints" / ckpt.dir_name(12) / "model_12.pt").write_bytes(b"torn")  # never completed
    model = digits_model(seed=2)
    assert load_into(model, run) == f"{run}/{ckpt.dir_name(8)}"
    assert_holds(model, trained)
    model = digits_model(seed=2)
    load_into(model, f"{run}/{ckpt.dir_name(4)}")  # one checkpoint named: that one
    assert_holds(model, older)
    with pytest.raises(InitFromError) as info:
        load_into(digits_model(), f"{run}/{ckpt.dir_name(12)}")
    assert str(info.value).startswith(f"model.init_from: '{run}/{ckpt.dir_name(12)}': the checkpoint does not "
                                      "verify (model_12.pt has 4 bytes, manifest says")
    assert "name another of the job's checkpoints, or its checkpoints folder" in str(info.value)


def test_prefixes_every_key_carries_and_the_model_lacks_are_stripped_only_then():
    keys = {"0.weight", "0.bias"}
    t = torch.zeros(1)
    assert set(strip_prefixes({"model.module.0.weight": t, "model.module.0.bias": t}, keys)) == keys
    assert set(strip_prefixes({"_orig_mod.0.weight": t, "_orig_mod.0.bias": t}, keys)) == keys
    kept = {"model.0.weight": t, "model.0.bias": t}
    assert strip_prefixes(kept, {"model.0.weight", "model.0.bias"}) == kept  # the model has them so
    mixed = {"model.0.weight": t, "loss.weight": t}
    assert strip_prefixes(mixed, keys) == mixed  # not one common prefix: left as is (and refused as a mismatch)


def test_weights_of_another_shape_are_refused_naming_every_mismatch(tmp_path, trained):
    other = dict(digits_model(hidden=32).state_dict())  # a wider hidden layer
    other["head.scale"] = torch.ones(1)
    del other["3.bias"]
    torch.save(other, tmp_path / "other.pt")
    model, before = digits_model(seed=2), digits_model(seed=2).state_dict()
    with pytest.raises(InitFromError) as info:
        load_into(model, str(tmp_path / "other.pt"))
    assert str(info.value) == (
        f"model.init_from: '{tmp_path}/other.pt': does not fit the model: missing keys (1): 3.bias; "
        "unexpected keys (1): head.scale; shapes differ (3): 0.bias: expected (16,), found (32,), "
        "0.weight: expected (16, 64), found (32, 64), 3.weight: expected (10, 16), found (10, 32): "
        "point model.init_from at weights saved from this same architecture (model.name or factory, its options "
        "and sizes), e.g. a checkpoint of a job with this model section")
    assert_holds(model, before)  # nothing half-loaded


class RunsOnLoad:
    """A pickle that would run code when loaded (here: create a file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        from pathlib import Path

        return Path.touch, (Path(self.marker),)


def test_a_pickle_holding_more_than_tensors_is_refused_and_never_run(tmp_path, trained):
    marker = tmp_path / "ran"
    torch.save({"state_dict": trained, "callback": RunsOnLoad(str(marker))}, tmp_path / "evil.ckpt")
    with pytest.raises(InitFromError) as info:
        load_into(digits_model(), str(tmp_path / "evil.ckpt"))
    assert not marker.exists(), "the pickle's code ran"
    message = str(info.value)
    assert message.startswith(f"model.init_from: '{tmp_path}/evil.ckpt': holds more than tensors, and a weights "
                              "file is never run as code (torch.load(weights_only=True) refused it: Unsupported global: GLOBAL ")
    assert "weights_only=False" not in message, "torch's advice to run the file as code is not passed on"
    assert message.endswith(": save the state dict alone (torch.save(model.state_dict(), path)) or as .safetensors")


def test_files_that_hold_no_weights_say_so(tmp_path):
    torch.save({"epoch": 3, "note": "no weights"}, tmp_path / "none.pt")
    with pytest.raises(InitFromError, match=r"holds no state dict \(found 'epoch', 'note'\): save tensors by name"):
        read_state_dict(str(tmp_path / "none.pt"))
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InitFromError, match=r"'.*bad.safetensors': not a readable .safetensors file .*: save it "
                                            r"again with safetensors.torch.save_file"):
        read_state_dict(str(tmp_path / "bad.safetensors"))
    (tmp_path / "bad.pt").write_bytes(b"garbage")
    with pytest.raises(InitFromError, match=r"not a readable torch file .*: save it with torch.save"):
        read_state_dict(str(tmp_path / "bad.pt"))


def test_what_the_driver_checks_before_ray_starts(tmp_path):
    with pytest.raises(InitFromError) as info:
        check_exists(str(tmp_path / "nope.pt"))
    assert str(info.value) == (f"model.init_from: '{tmp_path}/nope.pt': not found: check the path or the bucket "
                               "(a relative path is read from the directory you launch in)")
    (tmp_path / "weights.npz").write_bytes(b"x")
    with pytest.raises(InitFromError, match=r"'.*weights.npz': not a weights file this reads: use one of .pt, .pth, "
                                            r".bin, .ckpt, .safetensors, a job's checkpoint_<step> folder"):
        check_exists(str(tmp_path / "weights.npz"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InitFromError, match=r"'.*empty': a folder with no checkpoint_<step> folder in it: name a "
                                            r"job's checkpoints folder \(<storage root>/<job>/checkpoints\)"):
        check_exists(str(tmp_path / "empty"))
    with pytest.raises(InitFromError, match="scheme 'http' is not supported"):
        check_exists("http://example.com/w.pt")


def test_weights_on_s3_load_like_local_ones(s3_server, trained, tmp_path):
    import io

    import boto3
    from safetensors.torch import save

    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="init-weights")
    s3.put_object(Bucket="init-weights", Key="pretrained/w.safetensors", Body=save(trained))
    buffer = io.BytesIO()
    torch.save(lightning_like(trained), buffer)
    s3.put_object(Bucket="init-weights", Key="pretrained/lit.ckpt", Body=buffer.getvalue())
    for uri in ("s3://init-weights/pretrained/w.safetensors", "s3://init-weights/pretrained/lit.ckpt"):
        model = digits_model(seed=2)
        assert load_into(model, uri) == uri
        assert_holds(model, trained)
    with pytest.raises(InitFromError, match="'s3://init-weights/pretrained/missing.pt': not found"):
        check_exists("s3://init-weights/pretrained/missing.pt")
