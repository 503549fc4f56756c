"""A Hugging Face model as a workload (trainers.workloads.hf): loaded from a save_pretrained folder
with no network, its loss a SUM that agrees with Hugging Face's own mean, ignores padding and
masked labels, splits exactly across micro-batches, and trains: a classifier learns a synthetic
task to high held-out accuracy, in process (the Ray run is tests/integration/test_hf.py)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hf_models import (cls_folder, lm_folder, make_tokenizer, reviews,  # noqa: F401  (pytest fixtures, used by name)
                       write_documents, write_reviews)

from cluster.storage import open_root
from trainers.config.loading import validate
from trainers.workloads import resolve
from trainers.workloads.hf import HFWorkload

log = logging.getLogger(__name__)


def spec_for(tmp_path, folder, task, source, max_seq_len=32):
    columns = {"text": "body"} if task == "causal_lm" else {"text": "review", "label": "stars"}
    return validate({"model": {"hf": {"path": str(folder), "task": task}, "max_seq_len": max_seq_len},
                     "data": {"source": str(source), "columns": columns},
                     "checkpoint": {"storage_root": str(tmp_path / "st")}})


def test_resolve_gives_the_hf_workload(tmp_path, lm_folder):
    spec = spec_for(tmp_path, lm_folder, "causal_lm", tmp_path / "d.parquet")
    assert isinstance(resolve(spec), HFWorkload)


def test_causal_loss_is_hugging_faces_mean_as_a_sum_that_splits_exactly(tmp_path, lm_folder):
    spec = spec_for(tmp_path, lm_folder, "causal_lm", tmp_path / "d.parquet")
    work = resolve(spec)
    model = work.build_model(spec).eval()
    torch.manual_seed(0)
    ids = torch.randint(5, 300, (4, 32))
    mask = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": mask, "num_tokens": 4 * 32}
    total, n, tokens = work.loss_sum(model, batch)
    assert (n, tokens) == (4, 4 * 31)
    theirs = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    torch.testing.assert_close(total * 31 / tokens, theirs, rtol=1e-5, atol=1e-6)
    halves = [work.loss_sum(model, {"input_ids": ids[i:i + 2], "attention_mask": mask[i:i + 2], "num_tokens": 64})[0]
              for i in (0, 2)]
    torch.testing.assert_close(halves[0] + halves[1], total)


def test_padding_and_masked_labels_add_no_loss(tmp_path, lm_folder):
    spec = spec_for(tmp_path, lm_folder, "causal_lm", tmp_path / "d.parquet")
    work = resolve(spec)
    model = work.build_model(spec).eval()
    ids = torch.randint(5, 300, (1, 20))
    alone = work.loss_sum(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "num_tokens": 20})
    padded = torch.cat([ids, torch.full((1, 12), 7)], 1)  # any value: the mask says padding
    pmask = torch.cat([torch.ones(1, 20, dtype=torch.long), torch.zeros(1, 12, dtype=torch.long)], 1)
    with_pad = work.loss_sum(model, {"input_ids": padded, "attention_mask": pmask, "num_tokens": 20})
    torch.testing.assert_close(with_pad[0], alone[0])
    assert with_pad[2] == alone[2] == 19
    labels = ids.clone()
    labels[:, 10:] = -100
    masked = work.loss_sum(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
                                   "num_tokens": 20})[0]
    theirs = model(input_ids=ids, labels=labels).loss  # the mean over the 9 positions left
    torch.testing.assert_close(masked * 31 / 9, theirs, rtol=1e-5, atol=1e-6)


def test_classification_loss_is_summed_per_sample(tmp_path, cls_folder):
    spec = spec_for(tmp_path, cls_folder, "sequence_classification", tmp_path / "r.parquet", max_seq_len=64)
    work = resolve(spec)
    model = work.build_model(spec).eval()
    ids = torch.randint(5, 300, (6, 10))
    mask = torch.ones_like(ids)
    mask[3:, 7:] = 0
    y = torch.tensor([0, 1, 1, 0, 1, 0])
    total, n, tokens = work.loss_sum(model, {"input_ids": ids, "attention_mask": mask, "labels": y,
                                             "num_tokens": int(mask.sum())})
    theirs = model(input_ids=ids, attention_mask=mask, labels=y).loss
    torch.testing.assert_close(total / 6, theirs)
    assert (n, tokens) == (6, int(mask.sum()))


def test_loading_problems_name_the_field_and_the_fix(tmp_path, lm_folder):
    tokenizer_only = tmp_path / "tok"
    make_tokenizer(tokenizer_only)
    spec = spec_for(tmp_path, tokenizer_only, "causal_lm", tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"model.hf: '.*tok': cannot load it as AutoModelForCausalLM for task "
                                         r"'causal_lm' .*give a save_pretrained folder of a model with that head"):
        resolve(spec).build_model(spec)
    long = spec_for(tmp_path, lm_folder, "causal_lm", tmp_path / "d.parquet", max_seq_len=512)
    with pytest.raises(ValueError, match=r"model.max_seq_len: 512: longer than the model's max_position_embeddings "
                                         r"\(128\): set model.max_seq_len to 128 or less"):
        resolve(long).build_model(long)


def train_in_process(spec, steps: int, lr: float, batch: int, seed: int = 0):
    """Our workload's pieces without Ray: prepare, source, model, and the loss scaled to a mean."""
    work = resolve(spec)
    uri = work.prepare(spec, open_root(spec.checkpoint.storage_root))
    source = work.dataset(spec, uri)
    torch.manual_seed(seed)
    model = work.build_model(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        ids = rng.choice(len(source), batch, replace=False)
        [mb] = list(source.fetch(ids, [batch], []))
        total, n, _ = work.loss_sum(model, mb)
        (total / n).backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(total.detach()) / n)
    return work, model, source, losses


def test_a_classifier_fine_tunes_to_high_held_out_accuracy(tmp_path, cls_folder):
    source = write_reviews(tmp_path / "r.parquet", 1024, seed=1)
    spec = spec_for(tmp_path, cls_folder, "sequence_classification", source, max_seq_len=64)
    _, model, _, losses = train_in_process(spec, steps=50, lr=5e-3, batch=32)
    texts, labels = reviews(300, seed=12345)  # held out: never trained on
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(cls_folder), local_files_only=True)
    enc = tok(texts, padding=True, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        pred = model(**enc).logits.argmax(-1)
    accuracy = float((pred == torch.tensor(labels)).float().mean())
    log.info("held-out accuracy %.3f, loss %.3f -> %.3f", accuracy, losses[0], losses[-1])
    assert accuracy >= 0.9, (accuracy, losses[:3], losses[-3:])


def test_a_causal_lm_learns_from_packed_rows(tmp_path, lm_folder):
    source = write_documents(tmp_path / "d.parquet", 400, seed=1)
    spec = spec_for(tmp_path, lm_folder, "causal_lm", source)
    _, _, src, losses = train_in_process(spec, steps=60, lr=3e-3, batch=16)
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:5]), losses
    assert (src.lengths[:-1] == 32).all()  # packed: every row full but the last


def test_the_trained_model_is_exported_as_a_folder_from_pretrained_loads(tmp_path, cls_folder):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from trainers.workloads.hf import export_pretrained

    spec = spec_for(tmp_path, cls_folder, "sequence_classification", tmp_path / "r.parquet", max_seq_len=64)
    model = resolve(spec).build_model(spec)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # "trained": not the folder's weights
    root = open_root(str(tmp_path / "st"))
    uri = export_pretrained(spec, model.state_dict(), root, "job", "exported")
    assert uri == root.uri_of("job", "exported")
    loaded = AutoModelForSequenceClassification.from_pretrained(uri, local_files_only=True).eval()
    enc = AutoTokenizer.from_pretrained(uri, local_files_only=True)(["good dog", "the sad cat sat"], padding=True,
                                                                    return_tensors="pt")
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**enc).logits, model(**enc).logits)
