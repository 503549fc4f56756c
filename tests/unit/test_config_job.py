"""The job spec's models (trainers.config.job): every bad spec fails with its field path, plainly."""

from __future__ import annotations

import pytest

from trainers.config.errors import SpecError
from trainers.config.loading import validate

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
    ({"model": {"init_from": "gs://bucket/w.pt"}}, "model.init_from", "scheme 'gs' is not supported"),
    ({"model": {"init_from": "s3://"}}, "model.init_from", "needs a bucket"),
    ({"model": {"init_from": "w.pt"}, "train_loop": "userpkg:own_loop"}, "model.init_from",
     "'w.pt': not used by your own train_loop: load the weights in your loop, or drop train_loop to use ours"),
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


def test_loader_workers_take_a_count_or_auto():
    assert validate({"data": {"num_workers": "auto"}}).data.num_workers == "auto"
    assert validate({"data": {"num_workers": 3}}).data.num_workers == 3
