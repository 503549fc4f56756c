"""Spec text (trainers.config.parsing): broken or hostile text is refused fast, plainly, with its place."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainers.config.errors import SpecError
from trainers.config.loading import load_spec
from trainers.config.parsing import parse_text

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "configs" / "deployment-guide.json"


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


def test_truncated_file_via_cli(tmp_path):
    spec = tmp_path / "cut.json"
    spec.write_text(GUIDE.read_text()[:120])
    proc = subprocess.run([sys.executable, "-m", "trainers.train", str(spec)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "line" in proc.stderr and "fix the JSON syntax" in proc.stderr


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
