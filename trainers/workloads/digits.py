"""Classification of scikit-learn's handwritten digits (1,797 8x8 images, shipped in the package)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from cluster.storage import StorageRoot
from trainers.config.job import JobSpec
from trainers.data import FeatureSource, ParquetFiles
from trainers.workloads.datasets import prepare_data


class Digits:
    def prepare(self, spec: JobSpec, root: StorageRoot) -> str:
        return prepare_data(spec, root)

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
