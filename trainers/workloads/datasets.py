"""The built-in workloads' data sets, made on the driver: no torch here.

A driver (`etrain run`, a Ray Jobs driver of the service, a sweep trial) prepares the data
once and then only starts workers; the models and the loss, which need torch, are the
workers' (trainers.workloads.digits, trainers.workloads.lm).
"""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

from cluster.storage import StorageRoot
from trainers.config.job import JobSpec
from trainers.data.parquet import write_parquet

DIGITS_FILE = "datasets/digits-v1.parquet"


def digits_table() -> pa.Table:
    """The digits as a table: 64 features scaled to [0, 1] and an integer label."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    features = (bunch.data / 16.0).astype(np.float32)
    return pa.table({"features": list(features), "label": bunch.target.astype(np.int64)})


def prepare_builtin(spec: JobSpec, root: StorageRoot, rel: str, make_table: Callable[[], pa.Table]) -> str:
    """The user's Parquet source as is, or a built-in set converted once under the storage root."""
    if spec.data.source and not spec.data.source.startswith("builtin:"):
        return spec.data.source
    if not root.exists(rel):
        root.write_bytes(write_parquet(make_table()), rel)
    return root.uri_of(rel)


TEXT_FILE = "datasets/text-v1.parquet"
MIN_LEN, MAX_LEN, MAX_SEQUENCES = 16, 512, 8000


def stdlib_paragraphs(limit: int = MAX_SEQUENCES) -> list[bytes]:
    """Paragraphs of the standard library's module docstrings, in a fixed order."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    out: list[bytes] = []
    for path in sorted(lib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        docs = [ast.get_docstring(n) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        for doc in filter(None, docs):
            for para in doc.split("\n\n"):
                data = " ".join(para.split()).encode("utf-8")[:MAX_LEN]
                if len(data) >= MIN_LEN:
                    out.append(data)
                    if len(out) >= limit:
                        return out
    return out


def text_table() -> pa.Table:
    return pa.table({"tokens": [list(p) for p in stdlib_paragraphs()]})


def prepare_data(spec: JobSpec, root: StorageRoot) -> str:
    """The driver's part of the workload a spec asks for (trainers.workloads.resolve): make its data
    exist under ``root``, return its URI (a user factory's job reads its own: the source as given;
    a Hugging Face model's text is tokenized once, trainers.data.text)."""
    if spec.model.hf:
        from trainers.data.text import prepare_text

        return prepare_text(spec, root)
    if spec.model.factory or spec.data.factory:
        return spec.data.source or ""
    if spec.model.name == "tiny_gpt":
        return prepare_builtin(spec, root, TEXT_FILE, text_table)
    return prepare_builtin(spec, root, DIGITS_FILE, digits_table)
