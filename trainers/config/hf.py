"""``model.hf``: a Hugging Face ``save_pretrained`` model trained by our loop, and the rules it
brings to the rest of the spec (text data, its columns, the ``transformers`` install)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator

from cluster.storage import check_uri
from trainers.config.fields import Strict, refs_imported

if TYPE_CHECKING:
    from trainers.config.job import JobSpec

HF_TASKS = ("causal_lm", "sequence_classification")
HF_PACKAGES = "pip install transformers==5.23.0 tokenizers==0.23.3"
TEXT_SUFFIXES = (".parquet", ".jsonl")


class HFModel(Strict):
    path: str = Field(description="a save_pretrained folder: a local path or an s3://bucket/prefix")
    task: Literal["causal_lm", "sequence_classification"] = Field(
        description="causal_lm: next-token loss per token on packed rows; sequence_classification: a class per text")
    tokenizer: str | None = Field(None, description="another save_pretrained folder holding the tokenizer "
                                                    "(default: the model's own folder)")

    @field_validator("path", "tokenizer")
    @classmethod
    def _folder(cls, v: str | None) -> str | None:
        if v is None:
            return v
        problem = check_uri(v)
        if problem:
            raise ValueError(f"{problem} (a save_pretrained folder)")
        return v


def transformers_missing() -> bool:
    return importlib.util.find_spec("transformers") is None or importlib.util.find_spec("tokenizers") is None


def hf_problems(spec: JobSpec) -> list[str]:
    """What a spec with ``model.hf`` needs of the rest of it, as 'field: value: problem: fix' lines."""
    hf, data, model = spec.model.hf, spec.data, spec.model
    if hf is None:
        problems = []
        if data.columns.text is not None:
            problems.append(f"data.columns.text: {data.columns.text!r}: text is read only for model.hf: "
                            "set model.hf {path, task} or remove data.columns.text")
        if data.source and data.source.endswith(".jsonl"):
            problems.append(f"data.source: {data.source!r}: JSON Lines is read only for model.hf: "
                            "convert it to Parquet for this model")
        return problems
    problems = []
    if model.factory:
        problems.append(f"model.factory: {model.factory!r}: set together with model.hf: keep one of them")
    if data.factory:
        problems.append(f"data.factory: {data.factory!r}: model.hf reads text from data.source: "
                        "remove data.factory and set data.source")
    if not data.source or data.source.startswith("builtin:"):
        problems.append(f"data.source: {data.source!r}: model.hf needs your text: set data.source to a Parquet "
                        "or JSON Lines file or folder (local or s3://)")
    if not data.columns.text:
        problems.append("data.columns.text: missing: model.hf needs the column that holds the text: "
                        "set data.columns.text, e.g. text")
    if refs_imported() and transformers_missing():
        problems.append(f"model.hf: {hf.path!r}: needs the transformers and tokenizers packages, not installed "
                        f"here: {HF_PACKAGES}")
    return problems
