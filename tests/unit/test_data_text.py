"""Text tokenized once per data set and tokenizer (trainers.data.text), and read back by the loader's
source (trainers.data.sources.TextSource): packed causal-LM rows, classification rows with their
lengths, the cache's key, and every problem named with its field and fix."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hf_models import (cls_folder, lm_folder, make_causal_lm,  # noqa: F401  (pytest fixtures, used by name)
                       make_tokenizer, write_documents, write_reviews)

from cluster.storage import open_root
from trainers.config.loading import validate
from trainers.data import ParquetFiles, TextSource
from trainers.data import text as text_mod
from trainers.data.text import Packer, local_folder, prepare_text, read_meta


def lm_spec(tmp_path, model, source, max_seq_len=32, **data):
    return validate({"model": {"hf": {"path": str(model), "task": "causal_lm"}, "max_seq_len": max_seq_len},
                     "data": {"source": str(source), "columns": {"text": "body"}, **data},
                     "checkpoint": {"storage_root": str(tmp_path / "st")}})


def cls_spec(tmp_path, model, source, **columns):
    return validate({"model": {"hf": {"path": str(model), "task": "sequence_classification"}, "max_seq_len": 64},
                     "data": {"source": str(source), "columns": {"text": "review", "label": "stars", **columns}},
                     "checkpoint": {"storage_root": str(tmp_path / "st")}})


def test_packer_makes_full_rows_of_documents_each_ended_by_eos():
    p = Packer(4, eos_id=9)
    rows = p.add([[1, 2], [3, 4, 5, 9], [6]])  # the second already ends with EOS: not doubled
    assert [r.tolist() for r in rows] == [[1, 2, 9, 3], [4, 5, 9, 6]]
    assert [r.tolist() for r in p.add([[7, 8, 1]])] == [[9, 7, 8, 1]]
    assert [r.tolist() for r in p.finish()] == [[9]] or p.finish() == []


def test_causal_text_is_packed_into_full_rows_and_cached(tmp_path, lm_folder, caplog):
    source = write_documents(tmp_path / "docs.parquet", 300, seed=1)
    spec = lm_spec(tmp_path, lm_folder, source)
    root = open_root(spec.checkpoint.storage_root)
    with caplog.at_level("INFO", logger="trainers.data.text"):
        uri = prepare_text(spec, root)
    meta = read_meta(uri)
    assert meta["padding_fraction"] < 0.01, meta  # only the last row may be short
    assert "packed, padding 0." in caplog.text and "tokenized 300 texts" in caplog.text
    table = pq.read_table(ParquetFiles(uri).paths[0])
    lengths = [len(r) for r in table.column("input_ids").to_pylist()]
    assert set(lengths[:-1]) == {32} and meta["rows"] == len(lengths)
    assert meta["tokens"] == sum(lengths)
    # every document is there, EOS-separated, in order
    eos = make_tokenizer(tmp_path / "tok").eos_token_id
    flat = [t for r in table.column("input_ids").to_pylist() for t in r]
    assert flat.count(eos) == 300

    def no_tokenizing(folder):
        raise AssertionError("tokenized again")

    text_mod_load = text_mod.load_tokenizer
    text_mod.load_tokenizer = no_tokenizing
    try:
        assert prepare_text(spec, root) == uri  # the same inputs: found, not made again
    finally:
        text_mod.load_tokenizer = text_mod_load


def test_a_changed_tokenizer_file_or_setting_tokenizes_again(tmp_path, lm_folder):
    source = write_documents(tmp_path / "docs.parquet", 50, seed=1)
    root = open_root(str(tmp_path / "st"))
    first = prepare_text(lm_spec(tmp_path, lm_folder, source), root)
    assert prepare_text(lm_spec(tmp_path, lm_folder, source, max_seq_len=16), root) != first
    write_documents(source, 60, seed=2)
    os.utime(source, (time.time() + 5, time.time() + 5))
    second = prepare_text(lm_spec(tmp_path, lm_folder, source), root)
    assert second != first and read_meta(second)["texts"] == 60
    other = make_causal_lm(tmp_path / "lm2")
    (other / "tokenizer_config.json").write_text(
        json.dumps({**json.loads((other / "tokenizer_config.json").read_text()), "model_max_length": 77}))
    spec = validate({**lm_spec(tmp_path, lm_folder, source).model_dump(),
                     "model": {"hf": {"path": str(lm_folder), "task": "causal_lm", "tokenizer": str(other)},
                               "max_seq_len": 32}})
    assert prepare_text(spec, root) not in (first, second)


def test_json_lines_folders_are_read(tmp_path, lm_folder):
    write_documents(tmp_path / "text" / "a.jsonl", 40, seed=3)
    write_documents(tmp_path / "text" / "sub" / "b.parquet", 40, seed=4)
    uri = prepare_text(lm_spec(tmp_path, lm_folder, f"{tmp_path / 'text'}/"), open_root(str(tmp_path / "st")))
    assert read_meta(uri)["texts"] == 80 and len(ParquetFiles(uri).paths) == 2


def test_classification_rows_keep_their_lengths_and_labels(tmp_path, cls_folder):
    source = write_reviews(tmp_path / "r.parquet", 200, seed=5)
    spec = cls_spec(tmp_path, cls_folder, source)
    uri = prepare_text(spec, open_root(spec.checkpoint.storage_root))
    meta = read_meta(uri)
    src = TextSource(ParquetFiles(uri), meta["pad_id"], 64, label="label")
    assert len(src) == 200 and len(set(src.lengths.tolist())) > 5  # varied: dynamic batching buckets them
    assert "padding_fraction" not in meta and meta["mean_length"] == src.lengths.mean()
    ids = np.array([3, 0, 150, 7])
    [mb] = list(src.fetch(ids, [4], []))
    labels = pq.read_table(source).column("stars").to_numpy()
    assert mb["labels"].tolist() == labels[ids].tolist()
    assert mb["attention_mask"].sum(1).tolist() == src.lengths[ids].tolist()
    assert mb["num_tokens"] == int(src.lengths[ids].sum())
    cls_id = make_tokenizer(tmp_path / "t", classifier=True).cls_token_id
    assert (mb["input_ids"][:, 0] == cls_id).all()  # the tokenizer's own template was applied
    assert (mb["input_ids"][mb["attention_mask"] == 0] == meta["pad_id"]).all()


def test_problems_name_the_field_the_value_and_the_fix(tmp_path, cls_folder, lm_folder):
    root = open_root(str(tmp_path / "st"))
    source = write_reviews(tmp_path / "r.parquet", 20, seed=5)
    with pytest.raises(ValueError, match=r"data.columns.text: 'comment' is not a column of .*r.parquet \(it has "
                                         r"review, stars\): name the right one in data.columns.text"):
        prepare_text(cls_spec(tmp_path, cls_folder, source, text="comment"), root)
    with pytest.raises(ValueError, match=r"data.columns.label: 'grade' is not a column"):
        prepare_text(cls_spec(tmp_path, cls_folder, source, label="grade"), root)
    words = tmp_path / "w.parquet"
    pq.write_table(pa.table({"review": ["a b", "c"], "stars": ["good", "bad"]}), words)
    with pytest.raises(ValueError, match=r"data.columns.label: 'stars' in .* holds string: classification needs a "
                                         r"whole number class id"):
        prepare_text(cls_spec(tmp_path, cls_folder, words), root)
    empty = tmp_path / "e.parquet"
    pq.write_table(pa.table({"body": ["", None]}), empty)
    with pytest.raises(ValueError, match=r"data.source: '.*e.parquet': no text in column 'body'"):
        prepare_text(lm_spec(tmp_path, lm_folder, empty), root)
    with pytest.raises(FileNotFoundError, match=r"data.source: '.*nowhere.parquet': no such file or folder"):
        prepare_text(lm_spec(tmp_path, lm_folder, tmp_path / "nowhere.parquet"), root)
    (tmp_path / "bare").mkdir()
    with pytest.raises(FileNotFoundError, match=r"data.source: '.*bare/': the folder holds no .parquet or .jsonl"):
        prepare_text(lm_spec(tmp_path, lm_folder, f"{tmp_path / 'bare'}/"), root)
    with pytest.raises(FileNotFoundError, match=r"model.hf.path: '/no/model': no such folder here: give the folder "
                                                r"that save_pretrained wrote"):
        prepare_text(lm_spec(tmp_path, "/no/model", source), root)
    no_eos = tmp_path / "noeos"
    make_tokenizer(no_eos, eos=False)
    docs = write_documents(tmp_path / "d.parquet", 5, seed=1)
    with pytest.raises(ValueError, match=r"model.hf: '.*noeos': its tokenizer has no eos_token \(nor sep_token\) .*"
                                         r"set eos_token in its tokenizer_config.json"):
        prepare_text(lm_spec(tmp_path, no_eos, docs), root)


def test_an_s3_folder_is_copied_once_to_the_local_cache(tmp_path, lm_folder, s3_server):
    import boto3

    from cluster.storage import s3_filesystem

    boto3.client("s3").create_bucket(Bucket="hfbucket")
    fs = s3_filesystem()
    for f in lm_folder.iterdir():
        with fs.open_output_stream(f"hfbucket/models/lm/{f.name}") as out:
            out.write(f.read_bytes())
    cache = tmp_path / "cache"
    tok_only = local_folder("s3://hfbucket/models/lm", "model.hf.path", weights=False, cache=cache)
    assert not any(p.name.endswith(".safetensors") for p in os.scandir(tok_only))
    full = local_folder("s3://hfbucket/models/lm/", "model.hf.path", cache=cache)
    assert sorted(os.listdir(full)) == sorted([".complete", *os.listdir(lm_folder)])
    assert local_folder("s3://hfbucket/models/lm/", "model.hf.path", cache=cache) == full
    with pytest.raises(FileNotFoundError, match=r"model.hf.path: 's3://hfbucket/none': no files under this prefix"):
        local_folder("s3://hfbucket/none", "model.hf.path", cache=cache)
