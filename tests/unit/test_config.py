"""The job spec: the guide's template loads; every bad spec fails with its field path, plainly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainers.config.batching import batching_summary
from trainers.config.errors import SpecError
from trainers.config.loading import load_spec, validate
from trainers.config.parsing import parse_text

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "configs" / "deployment-guide.json"


def test_guide_template_loads_unchanged():
    spec = load_spec(GUIDE)
    assert spec.name == "deployment-guide"
    assert (spec.training.batch_size, spec.training.learning_rate, spec.training.epochs) == (256, 5e-5, 10)
    assert spec.training.optimizer == "AdamW"
    assert spec.distributed.backend == "nccl" and spec.distributed.master_port == 29500
    assert spec.checkpoint.interval == 1000
    assert spec.checkpoint.run_folder == "checkpoints"
    assert spec.checkpoint.file_name(1000) == "model_1000.pt"


def test_all_example_configs_load():
    from trainers.sweep.spec import load_sweep

    for path in sorted((REPO / "configs").glob("*")):
        load_sweep(path) if "sweep:" in path.read_text() else load_spec(path)


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "My Job.yaml"
    p.write_text("training:\n  batch_size: 32\n")
    spec = load_spec(p, ["training.max_steps=7", "distributed.num_workers={min: 1, max: 2}", "data.shuffle=false"])
    assert spec.name == "my-job"
    assert spec.training.max_steps == 7 and spec.data.shuffle is False
    assert (spec.distributed.min_workers, spec.distributed.max_workers) == (1, 2)


BAD_SPECS = [
    ({"training": {"batch_size": "lots"}}, "training.batch_size", "whole number"),
    ({"training": {"batch_size": -4}}, "training.batch_size", "greater than 0"),
    ({"training": {"learning_rate": 0}}, "training.learning_rate", "greater than 0"),
    ({"training": {"optimizer": "Lion"}}, "training.optimizer", "'AdamW', 'Adam' or 'SGD'"),
    ({"training": {"batch_sise": 8}}, "training.batch_sise", "valid keys here are batch_size"),
    ({"trainng": {}}, "trainng", "valid keys here are name, training"),
    ({"distributed": {"num_workers": {"min": 4, "max": 2}}}, "distributed.num_workers", "min (4) is greater than max (2)"),
    ({"distributed": {"num_workers": 0}}, "distributed.num_workers", "positive integer"),
    ({"distributed": {"backend": "mpi"}}, "distributed.backend", "'auto', 'nccl' or 'gloo'"),
    ({"distributed": {"master_port": 70000}}, "distributed.master_port", "less than or equal to 65535"),
    ({"checkpoint": {"path": "../../etc/model_{step}.pt"}}, "checkpoint.path", "escapes the job's folder"),
    ({"checkpoint": {"path": "s3://b/model.pt"}}, "checkpoint.path", "checkpoint.storage_root"),
    ({"checkpoint": {"report_interval_s": -1}}, "checkpoint.report_interval_s", "greater than or equal to 0"),
    ({"distributed": {"resize_checkpoint_timeout_s": -5}}, "distributed.resize_checkpoint_timeout_s",
     "greater than or equal to 0"),
    ({"checkpoint": {"path": "model_{epoch}.pt"}}, "checkpoint.path", "only the placeholder '{step}' is allowed"),
    ({"checkpoint": {"path": "m_{step:>2000000000}.pt"}}, "checkpoint.path", "written exactly so (no format spec)"),
    ({"checkpoint": {"path": "m_{step!r}.pt"}}, "checkpoint.path", "only the placeholder '{step}'"),
    ({"checkpoint": {"path": "m_{{step}}.pt"}}, "checkpoint.path", "only the placeholder '{step}'"),
    ({"checkpoint": {"path": "/model_{step}.pt"}}, "checkpoint.path", "an absolute path names the job's folder"),
    ({"checkpoint": {"storage_root": "ftp://host/x"}}, "checkpoint.storage_root", "scheme 'ftp'"),
    ({"checkpoint": {"storage_root": "s3://"}}, "checkpoint.storage_root", "needs a bucket"),
    ({"checkpoint": {"interval": 0}}, "checkpoint.interval", "greater than 0"),
    ({"data": {"source": "builtin:imagenet"}}, "data.source", "unknown built-in data set"),
    ({"data": {"source": "/data/train.csv"}}, "data.source", ".parquet"),
    ({"data": {"num_workers": "many"}}, "data.num_workers", "or 'auto' to measure and choose"),
    ({"data": {"num_workers": -1}}, "data.num_workers", "0 or more loader processes"),
    ({"data": {"shuffle_window_row_groups": 0}}, "data.shuffle_window_row_groups", "greater than 0"),
    ({"data": {"columns": {"feature": "x"}}}, "data.columns.feature", "valid keys here are features, label, tokens"),
    ({"model": {"factory": "no_such_pkg.models:build"}}, "model.factory", "cannot import module 'no_such_pkg.models'"),
    ({"model": {"factory": "json:no_such_fn"}}, "model.factory", "no callable 'no_such_fn'"),
    ({"model": {"factory": "not a ref"}}, "model.factory", "package.module:function"),
    ({"train_loop": "nowhere:fn"}, "train_loop", "cannot import module 'nowhere'"),
    ({"name": "Has Spaces"}, "name", "lowercase letters"),
    ({"training": {"batch_size": 2}, "distributed": {"num_workers": 4}}, "training.batch_size", "smaller than the most workers"),
    ({"training": {"grad_accum_steps": 2, "micro_batch_size": 4}}, "training.grad_accum_steps", "set one"),
    ({"model": {"name": "mlp"}, "data": {"source": "builtin:text"}}, "data.source", "fits model.name 'tiny_gpt'"),
    ({"model": {"name": "tiny_gpt", "d_model": 100, "n_heads": 3}}, "model", "not a multiple of n_heads"),
]


@pytest.mark.parametrize("data,path,message", BAD_SPECS, ids=[b[1] + ":" + b[2][:20] for b in BAD_SPECS])
def test_bad_spec_names_field_and_fix(data, path, message):
    with pytest.raises(SpecError) as info:
        validate(data)
    hits = [p for p in info.value.problems if p.startswith(path + ":") and message in p]
    assert hits, info.value.problems


def test_every_problem_is_listed_at_once():
    with pytest.raises(SpecError) as info:
        validate({"training": {"batch_size": 0, "epochs": -1, "optimizer": "x"}, "bogus": 1})
    assert len(info.value.problems) == 4


@pytest.mark.parametrize("text,where", [
    ('{"training": {"batch_size": 256,\n  "epochs": ', "line 2"),
    ("training:\n  batch_size: [1, 2\n", "line 3"),
    ("", "empty"),
    ("- just\n- a list\n", "top level is list"),
])
def test_broken_files_name_the_line(tmp_path, text, where):
    p = tmp_path / "spec.yaml"
    p.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(p)
    assert where in info.value.problems[0]


def test_bad_override_is_reported(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("{}")
    with pytest.raises(SpecError) as info:
        load_spec(p, ["training.max_steps"])
    assert "expected key.path=value" in info.value.problems[0]
    with pytest.raises(SpecError) as info:
        load_spec(p, ["training.max_stepz=3"])
    assert info.value.problems[0].startswith("training.max_stepz: unknown key")


@pytest.mark.parametrize("data", [
    {"training": {"optimizer": "Lion"}},
    {"checkpoint": {"path": "../escape_{step}.pt"}},
    {"data": {"factory": "missing_mod:make"}},
])
def test_cli_rejects_without_traceback_ray_or_storage(tmp_path, data):
    root = tmp_path / "root"
    data = {**data, "checkpoint": {**data.get("checkpoint", {}), "storage_root": str(root)}}
    spec = tmp_path / "bad.json"
    spec.write_text(json.dumps(data))
    probe = ("import sys; from trainers.cli import main; code = main(['run', sys.argv[1]]); "
             "print('ray imported:', 'ray' in sys.modules); sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", probe, str(spec)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "invalid job spec" in proc.stderr
    assert "ray imported: False" in proc.stdout, "a bad spec must be refused before Ray is even imported"
    assert not root.exists(), "nothing may be written for a bad spec"


def test_truncated_file_via_cli(tmp_path):
    spec = tmp_path / "cut.json"
    spec.write_text(GUIDE.read_text()[:120])
    proc = subprocess.run([sys.executable, "-m", "trainers.train", str(spec)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "line" in proc.stderr and "fix the JSON syntax" in proc.stderr


def test_help_teaches():
    proc = subprocess.run([sys.executable, "-m", "trainers.cli", "run", "--help"], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 0
    assert "--stop-at-step" in proc.stdout and "resumes" in proc.stdout


@pytest.mark.parametrize("world,micro,accum,expected", [
    (2, None, None, (128, 128, 1)),
    (4, None, None, (64, 64, 1)),
    (3, None, None, (86, 86, 1)),
    (2, 32, None, (128, 32, 4)),
    (1, 32, None, (256, 32, 8)),
    (2, None, 4, (128, 32, 4)),
    (8, 64, None, (32, 32, 1)),
])
def test_batching_follows_from_global_batch(world, micro, accum, expected):
    assert batching_summary(256, world, micro, accum) == expected


BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"


@pytest.mark.parametrize("text,fmt,expected", [
    (BOMB, "auto", "line 1: YAML anchors and aliases (& and *) are not accepted"),
    ("training: &t {batch_size: 8}\n", "auto", "anchors and aliases"),
    ("a: " + "[" * 40 + "]" * 40, "auto", "nested deeper than 32 levels"),
    ("a: " + "[" * 5000 + "]" * 5000, "auto", "fix the YAML syntax"),  # libyaml's own limit
    ("- 1\n" * 30000, "auto", "more than 20000 values"),
    ("seed: " + "9" * 5000, "auto", "a number of 5000 digits: numbers in a spec have at most 30 digits"),
    ('{"seed": ' + "9" * 5000 + "}", "json", "a number of 5000 digits"),
    ('{"a": ' + "[" * 100000 + "]" * 100000 + "}", "json", "nested deeper than 32 levels"),
    ('{"a": ' + "[" * 40 + "]" * 40 + "}", "json", "nested deeper than 32 levels"),
    ("[" + "1," * 30000 + "1]", "json", "more than 20000 values"),
])
def test_hostile_spec_text_is_refused_fast_and_plainly(text, fmt, expected):
    import time

    from trainers.config.parsing import parse_text

    started = time.perf_counter()
    with pytest.raises(SpecError) as info:
        parse_text(text, "body", fmt)
    assert expected in info.value.problems[0] and info.value.problems[0].startswith("body: ")
    assert time.perf_counter() - started < 5  # generous: the point is no blow-up, not a speed figure


def test_the_service_validates_without_importing_what_a_spec_names(tmp_path, monkeypatch):
    from trainers.config.fields import refs_not_imported

    marker = tmp_path / "imported"
    (tmp_path / "sideeffect_mod.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef make(): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = {"model": {"factory": "sideeffect_mod:make"}, "data": {"factory": "sideeffect_mod:make"}}
    with refs_not_imported():
        validate(spec)
        with pytest.raises(SpecError, match="must look like 'package.module:function'"):
            validate({"train_loop": "not a ref"})
    assert not marker.exists()
    validate(spec)  # outside the block (etrain run): imported, so a typo fails before anything starts
    assert marker.exists()


@pytest.mark.parametrize("text,expected", [
    ("training: {max_steps: 5}\ndata: {options: {x: !!binary AAAA/w==}}\n",
     "body: data.options.x: binary data (!!binary): a spec holds text, numbers, true/false, lists and mappings only"),
    ("model: {options: {x: !!set {a, b}}}\n", "body: model.options.x: a set (!!set): a spec holds text"),
    ("model: {options: {x: [1, !!binary AAAA]}}\n", "body: model.options.x[1]: binary data (!!binary)"),
    ("model: {options: {!!binary AAAA: 1}}\n", "as a key"),
    ("name: !!binary AAAA/w==\n", "body: name: binary data (!!binary)"),
])
def test_yaml_values_json_cannot_hold_are_refused_naming_the_field(text, expected):
    from trainers.config.parsing import parse_text

    with pytest.raises(SpecError) as info:
        parse_text(text, "body")
    assert expected in info.value.problems[0], info.value.problems


def test_yaml_dates_and_times_stay_the_text_written():
    import json

    from trainers.config.parsing import parse_text

    data = parse_text("model: {options: {at: 2001-12-14t21:59:43.10-05:00, day: 2002-12-14, "
                      "2003-01-01: k}}\n", "body")
    assert data["model"]["options"] == {"at": "2001-12-14t21:59:43.10-05:00", "day": "2002-12-14", "2003-01-01": "k"}
    json.dumps(data)  # the service stores a spec as JSON


def test_loader_workers_take_a_count_or_auto():
    assert validate({"data": {"num_workers": "auto"}}).data.num_workers == "auto"
    assert validate({"data": {"num_workers": 3}}).data.num_workers == 3


@pytest.mark.parametrize("text, fmt, message", [
    ('{"model": {"factory": "' + "a" * 200_000 + '"}}', "json",
     'model.factory: a text of 200000 characters ("aaaa'),
    ("model:\n  options:\n    x: " + "b" * 5000 + "\n", "auto", "line 3: a text of 5000 characters"),
    ('{"model": {"options": {"' + "k" * 300 + '": 1}}}', "json", "model.options: a key of 300 characters"),
    ('{"training": {"learning_rate": NaN}}', "json", "NaN: not a number a spec can hold: write a finite number"),
    ('{"training": {"learning_rate": -Infinity}}', "json", "-Infinity: not a number a spec can hold"),
    ("training:\n  learning_rate: .nan\n", "auto", "training.learning_rate: nan: not a number a spec can hold"),
    ("training:\n  learning_rate: .inf\n", "auto", "training.learning_rate: inf: not a number a spec can hold"),
])
def test_long_texts_and_non_finite_numbers_are_refused_with_their_place(text, fmt, message):
    """Every spec text is short (a page, a log line and each regex over them stay cheap) and every
    number finite (a NaN stored in a record broke the JSON answers after the job existed)."""
    with pytest.raises(SpecError) as err:
        parse_text(text, "body", fmt)
    assert message in err.value.problems[0], err.value.problems
    assert err.value.problems[0].startswith("body: ")
    assert len(err.value.problems[0]) < 400  # the refusal does not echo the whole text back


def test_options_are_small_plain_data():
    deep: dict = {"v": 1}
    for _ in range(7):
        deep = {"d": deep}
    with pytest.raises(SpecError) as err:
        validate({"model": {"options": deep}})
    assert err.value.problems[0].startswith("model.options: {") and "}: nested 9 levels deep: options are at most 6 " \
        "levels: flatten them" in err.value.problems[0]
    with pytest.raises(SpecError) as err:
        validate({"data": {"options": {"rows": list(range(5000))}}})
    assert "data.options: {...}:" in err.value.problems[0] and "options hold at most 16384 bytes" in err.value.problems[0]
    assert validate({"model": {"options": {"a": {"b": [1, 2, {"c": "x"}]}}}}).model.options["a"]["b"][2] == {"c": "x"}


def test_a_spec_changed_after_it_was_checked_is_not_run(tmp_path):
    """The service passes the digest of the spec it checked; the attempt reads the stored bytes, and
    bytes that differ (a tenant's keys write near them) are refused before they are parsed."""
    import hashlib
    import subprocess
    import sys

    from trainers.sweep.spec import load_sweep

    spec = tmp_path / "j-1.json"
    spec.write_text('{"name": "j-1", "training": {"max_steps": 3}}')
    digest = hashlib.sha256(spec.read_bytes()).hexdigest()
    assert load_spec(spec, sha256=digest).training.max_steps == 3
    spec.write_text('{"name": "j-1", "training": {"max_steps": 4}}')
    with pytest.raises(SpecError) as err:
        load_spec(spec, sha256=digest)
    assert err.value.problems == [f"{spec}: its SHA-256 is not {digest}, the digest of the spec that was checked: it "
                                  "was changed after it was checked, so it is not run; submit the spec again"]
    with pytest.raises(SpecError, match="it was changed after it was checked"):
        load_sweep(spec, sha256=digest)
    run = subprocess.run([sys.executable, "-m", "trainers.train", str(spec), "--spec-sha256", digest.upper()],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 2 and "it was changed after it was checked, so it is not run" in run.stderr, run.stderr
