"""A Hugging Face model from a ``save_pretrained`` folder, trained by our loop (``model.hf``).

The model loads with ``AutoModelForCausalLM`` or ``AutoModelForSequenceClassification``
(``from_pretrained(folder, local_files_only=True)``; an s3:// folder is copied to a local
cache first, ``trainers.data.text.local_folder``); its text was tokenized once on the driver
(``trainers.data.text``). The loss is ours, a SUM the loop scales to the global batch, so the
update is the same whatever the world size and the split into micro-batches:

- causal_lm: the next-token cross-entropy summed over every predicted position (shifted
  labels; padding, a row's first token and labels set to -100 excluded), divided by the
  fixed ``max_seq_len - 1`` positions a packed row predicts. A constant divisor keeps the sum
  linear in tokens (every token weighs the same wherever it lands); on packed rows the loop's
  mean per row is then the mean per token. ``tokens`` counts the predicted positions.
- sequence_classification: cross-entropy summed over samples (mean squared error when the
  model has one output, as Hugging Face treats ``num_labels: 1``).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from cluster.storage import StorageRoot
from trainers.config.job import JobSpec
from trainers.data import ParquetFiles, TextSource
from trainers.data.text import local_folder, prepare_text, read_meta

log = logging.getLogger(__name__)

IGNORE = -100  # Hugging Face's label for "no loss here"


class HFWorkload:
    def __init__(self, task: str, max_seq_len: int):
        self.task, self.max_seq_len = task, max_seq_len

    def prepare(self, spec: JobSpec, root: StorageRoot) -> str:
        return prepare_text(spec, root)

    def dataset(self, spec: JobSpec, data_uri: str) -> TextSource:
        meta = read_meta(data_uri)
        label = "label" if self.task == "sequence_classification" else None
        return TextSource(ParquetFiles(data_uri), meta["pad_id"], self.max_seq_len, label)

    def build_model(self, spec: JobSpec) -> nn.Module:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        hf = spec.model.hf
        folder = local_folder(hf.path, "model.hf.path")
        auto = AutoModelForCausalLM if self.task == "causal_lm" else AutoModelForSequenceClassification
        try:
            model = auto.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"model.hf: {hf.path!r}: cannot load it as {auto.__name__} for task {self.task!r} "
                             f"({type(exc).__name__}: {str(exc)[:300]}): give a save_pretrained folder of a model "
                             "with that head, or change model.hf.task") from None
        longest = getattr(model.config, "max_position_embeddings", None)
        if longest is not None and spec.model.max_seq_len > longest:
            raise ValueError(f"model.max_seq_len: {spec.model.max_seq_len}: longer than the model's "
                             f"max_position_embeddings ({longest}): set model.max_seq_len to {longest} or less")
        if self.task == "causal_lm":
            model.config.use_cache = False  # training keeps no key/value cache
        if spec.training.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    def loss_sum(self, model: nn.Module, batch) -> tuple[torch.Tensor, int, int]:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        n = ids.shape[0]
        logits = model(input_ids=ids, attention_mask=mask).logits
        if self.task == "causal_lm":
            return causal_lm_loss_sum(logits, ids, mask, batch.get("labels"), self.max_seq_len - 1), n, \
                batch["num_tokens"] - n
        logits = logits.float()
        if logits.shape[-1] == 1:
            return F.mse_loss(logits.squeeze(-1), batch["labels"].float(), reduction="sum"), n, batch["num_tokens"]
        return F.cross_entropy(logits, batch["labels"], reduction="sum"), n, batch["num_tokens"]


def causal_lm_loss_sum(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor | None,
                       positions: int) -> torch.Tensor:
    """Next-token cross-entropy summed over the predicted positions, divided by ``positions``.
    Position t predicts token t+1 when both are real (not padding) and its label is not -100."""
    target = (ids if labels is None else labels)[:, 1:].clone()
    target[(mask[:, 1:] == 0) | (mask[:, :-1] == 0)] = IGNORE
    per_token = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), target.reshape(-1),
                                ignore_index=IGNORE, reduction="sum")
    return per_token / positions


def export_pretrained(spec: JobSpec, state: dict, root: StorageRoot, *parts: str) -> str:
    """The trained weights ``state`` in the model's own class, saved with the tokenizer by
    ``save_pretrained`` under ``parts`` of ``root`` (local or S3): a folder ``from_pretrained`` loads.
    The URI of that folder."""
    from trainers.data.text import load_tokenizer

    hf = spec.model.hf
    model = HFWorkload(hf.task, spec.model.max_seq_len).build_model(spec)
    if spec.training.gradient_checkpointing:
        model.gradient_checkpointing_disable()
    model.load_state_dict(state)
    model.config.use_cache = True  # for generation, once loaded
    tokenizer = load_tokenizer(local_folder(hf.tokenizer or hf.path, "model.hf.tokenizer" if hf.tokenizer
                                            else "model.hf.path", weights=False))
    with tempfile.TemporaryDirectory(prefix="etrain-export-") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for path in sorted(Path(tmp).rglob("*")):
            if path.is_file():
                root.write_bytes(path.read_bytes(), *parts, path.relative_to(tmp).as_posix())
    uri = root.uri_of(*parts)
    log.info("exported the trained model and its tokenizer (save_pretrained): %s", uri)
    return uri
