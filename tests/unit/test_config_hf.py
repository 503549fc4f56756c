"""``model.hf`` in the job spec (trainers.config.hf): what it needs of the rest, each problem
named with its field, its value and the fix."""

from __future__ import annotations

import pytest

from trainers.config import hf as hf_config
from trainers.config.errors import SpecError
from trainers.config.fields import refs_not_imported
from trainers.config.loading import validate

GOOD = {"model": {"hf": {"path": "/models/tiny", "task": "sequence_classification"}},
        "data": {"source": "/data/reviews/", "columns": {"text": "review", "label": "stars"}}}


def spec_with(**sections) -> dict:
    out = {k: dict(v) for k, v in GOOD.items()}
    for section, fields in sections.items():
        out[section] = {**out.get(section, {}), **fields}
    return out


def problems_of(data: dict) -> str:
    with pytest.raises(SpecError) as err:
        validate(data)
    return str(err.value)


def test_a_good_hf_spec_validates():
    spec = validate(GOOD)
    assert spec.model.hf.task == "sequence_classification" and spec.model.hf.tokenizer is None
    assert spec.data.columns.text == "review"
    lm = validate(spec_with(model={"hf": {"path": "s3://bucket/models/gpt", "task": "causal_lm",
                                          "tokenizer": "s3://bucket/tok"}},
                            data={"source": "s3://bucket/text/part.jsonl", "columns": {"text": "body"}}))
    assert lm.model.hf.path == "s3://bucket/models/gpt" and lm.data.source.endswith(".jsonl")


@pytest.mark.parametrize(("change", "field", "words"), [
    ({"model": {"hf": {"path": "/m", "task": "translation"}}}, "model.hf.task", "'causal_lm' or 'sequence_classification'"),
    ({"model": {"hf": {"task": "causal_lm"}}}, "model.hf.path", "missing"),
    ({"model": {"hf": {"path": "ftp://host/m", "task": "causal_lm"}}}, "model.hf.path", "scheme 'ftp'"),
    ({"model": {"hf": {"path": "/m", "task": "causal_lm", "tokeniser": "/t"}}}, "model.hf.tokeniser",
     "valid keys here are path, task, tokenizer"),
    ({"data": {"source": "/data/train.csv"}}, "data.source", ".jsonl"),
])
def test_field_problems_name_the_field_and_the_fix(change, field, words):
    data = spec_with(**change)
    if "model" in change:
        data["model"] = change["model"]
    text = problems_of(data)
    assert f"{field}:" in text and words in text, text


def test_hf_needs_a_text_source_and_its_column():
    text = problems_of({"model": GOOD["model"]})
    assert "data.source: None: model.hf needs your text: set data.source" in text
    assert "data.columns.text: missing: model.hf needs the column that holds the text" in text
    text = problems_of(spec_with(data={"source": "builtin:text", "columns": {}}))
    assert "data.source: 'builtin:text': model.hf needs your text" in text
    assert "fits model.name" not in text  # the built-in rule does not speak for an hf model


def test_hf_excludes_factories():
    text = problems_of(spec_with(model={"factory": "trainers.workloads:resolve"},
                                 data={"factory": "trainers.workloads:resolve"}))
    assert "model.factory: 'trainers.workloads:resolve': set together with model.hf: keep one" in text
    assert "data.factory: 'trainers.workloads:resolve': model.hf reads text from data.source" in text


def test_text_settings_without_hf_are_errors():
    text = problems_of({"data": {"source": "/d/x.jsonl", "columns": {"text": "t"}},
                        "model": {"factory": "trainers.workloads:resolve"}})
    assert "data.columns.text: 't': text is read only for model.hf" in text
    assert "data.source: '/d/x.jsonl': JSON Lines is read only for model.hf: convert it to Parquet" in text


def test_a_missing_transformers_install_is_named(monkeypatch):
    monkeypatch.setattr(hf_config, "transformers_missing", lambda: True)
    text = problems_of(GOOD)
    assert "model.hf: '/models/tiny': needs the transformers and tokenizers packages" in text
    assert "pip install transformers==" in text
    with refs_not_imported():  # the service checks names only: the job's cluster has its own packages
        validate(GOOD)
