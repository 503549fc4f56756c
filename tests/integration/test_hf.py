"""Hugging Face models (model.hf) trained by our loop on a real local Ray with 2 gloo workers: a
BERT classifier from a save_pretrained folder fine-tunes to high held-out accuracy with
length-bucketed batches, and a Llama causal LM trains on packed rows with almost no padding.
Models and tokenizers are made here from configs (tests/fixtures/hf_models.py): nothing is
downloaded."""

from __future__ import annotations

import logging

import pytest
import torch
from hf_models import make_causal_lm, make_classifier, reviews, write_documents, write_reviews

from cluster.storage import open_root
from trainers import checkpoint_files as ckpt
from trainers.config.loading import validate
from trainers.launch import EXIT_OK, run_job

pytestmark = pytest.mark.ray
log = logging.getLogger(__name__)


def hf_spec(root, name, folder, task, source, columns, steps, batch, max_seq_len, lr, **data):
    return validate({
        "name": name,
        "training": {"batch_size": batch, "learning_rate": lr, "max_steps": steps, "log_interval_steps": 5},
        "distributed": {"num_workers": 2, "backend": "gloo"},
        "checkpoint": {"interval": 10, "storage_root": str(root)},
        "model": {"hf": {"path": str(folder), "task": task}, "max_seq_len": max_seq_len},
        "data": {"source": str(source), "columns": columns, **data},
    })


def final_model_state(summary: dict) -> dict:
    root = open_root(summary["storage"])
    return ckpt.load_state(root.fs, summary["checkpoint_uri"].removeprefix("s3://"))["model"]


def test_a_classifier_fine_tunes_on_two_workers_to_high_held_out_accuracy(ray_local, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = make_classifier(tmp_path / "bert")
    source = write_reviews(tmp_path / "reviews.parquet", 1024, seed=1)
    spec = hf_spec(tmp_path / "st", "hf-cls", folder, "sequence_classification", source,
                   {"text": "review", "label": "stars"}, steps=50, batch=32, max_seq_len=64, lr=5e-3,
                   dynamic_batching=True, max_tokens_per_batch=256)
    code, summary = run_job(spec)
    assert code == EXIT_OK, summary
    assert summary["world_size"] == 2 and summary["final_step"] == 50
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), local_files_only=True)
    model.load_state_dict(final_model_state(summary))
    texts, labels = reviews(300, seed=12345)  # held out
    enc = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)(texts, padding=True, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        accuracy = float((model(**enc).logits.argmax(-1) == torch.tensor(labels)).float().mean())
    log.info("hf classifier on 2 workers: held-out accuracy %.3f, final loss %.3f", accuracy, summary["final_loss"])
    assert accuracy >= 0.9, (accuracy, summary)
    assert summary["text_data"]["rows"] == 1024
    # the exported folder is the last checkpoint's model, loaded as any Hugging Face model
    exported = AutoModelForSequenceClassification.from_pretrained(summary["exported_model"], local_files_only=True)
    exported.eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(**enc).logits, model(**enc).logits)
    assert AutoTokenizer.from_pretrained(summary["exported_model"], local_files_only=True)("good")["input_ids"] == \
        AutoTokenizer.from_pretrained(str(folder), local_files_only=True)("good")["input_ids"]


def test_a_causal_lm_trains_on_packed_rows_on_two_workers(ray_local, tmp_path):
    folder = make_causal_lm(tmp_path / "llama")
    source = write_documents(tmp_path / "docs.jsonl", 600, seed=1)
    spec = hf_spec(tmp_path / "st", "hf-lm", folder, "causal_lm", source, {"text": "body"},
                   steps=30, batch=16, max_seq_len=64, lr=3e-3)
    code, summary = run_job(spec)
    assert code == EXIT_OK, summary
    padding = summary["text_data"]["padding_fraction"]
    log.info("hf causal LM on 2 workers: padding fraction %.4f of %d packed rows, final loss %.3f",
             padding, summary["text_data"]["rows"], summary["final_loss"])
    assert padding < 0.01, summary["text_data"]
    assert summary["final_loss"] < 4.0, summary  # from ln(vocab) ~ 6 at random
