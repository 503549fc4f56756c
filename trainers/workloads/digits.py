"""Classification of scikit-learn's handwritten digits (1,797 8x8 images, shipped in the package)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import torch
from torch import nn
from torch.nn import functional as F

from cluster.storage import StorageRoot
from trainers.config import JobSpec
from trainers.data import FeatureSource, ParquetFiles, write_parquet

DATASET_FILE = "datasets/digits-v1.parquet"


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


class Digits:
    def prepare(self, spec: JobSpec, root: StorageRoot) -> str:
        return prepare_builtin(spec, root, DATASET_FILE, digits_table)

    def dataset(self, spec: JobSpec, data_uri: str) -> FeatureSource:
        c = spec.data.columns
        return FeatureSource(ParquetFiles(data_uri), c.features, c.label)

    def build_model(self, spec: JobSpec) -> nn.Module:
        h = spec.model.hidden_size
        return nn.Sequential(nn.Linear(64, h), nn.ReLU(), nn.Dropout(spec.model.dropout), nn.Linear(h, 10))

    def loss_sum(self, model: nn.Module, batch) -> tuple[torch.Tensor, int, int]:
        logits = model(batch["x"])
        n = batch["y"].shape[0]
        return F.cross_entropy(logits.float(), batch["y"], reduction="sum"), n, 0
