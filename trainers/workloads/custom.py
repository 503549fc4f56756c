"""A user's own model and data, trained by our loop: ``model.factory`` and ``data.factory``.

``model.factory`` returns an ``nn.Module`` (called with ``model.options`` as keywords);
``data.factory`` returns a map-style Dataset of ``(input, target)`` pairs (called with
``data.options``), or ``data.source`` names a Parquet file with ``features``/``label``.
The loss is ``model.loss`` (cross_entropy or mse) over the module's output.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, default_collate

from cluster.storage import StorageRoot
from trainers.config import JobSpec
from trainers.data import FeatureDataset, read_table


def load_ref(ref: str):
    module_name, attr = ref.split(":")
    return getattr(importlib.import_module(module_name), attr)


class _Pairs(Dataset):
    """Adapts a user's dataset of (input, target) pairs to the loop's batch dicts."""

    def __init__(self, inner: Dataset):
        self.inner = inner
        self.lengths = getattr(inner, "lengths", None)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        return self.inner[i]

    def collate(self, items):
        x, y = default_collate(items)
        return {"x": x, "y": y}


class CustomWorkload:
    def __init__(self, loss: str = "cross_entropy"):
        self.loss = loss

    def prepare(self, spec: JobSpec, root: StorageRoot) -> str:
        return spec.data.source or ""

    def dataset(self, spec: JobSpec, data_uri: str) -> Dataset:
        if spec.data.factory:
            return _Pairs(load_ref(spec.data.factory)(**spec.data.options))
        return FeatureDataset(read_table(data_uri))

    def build_model(self, spec: JobSpec) -> nn.Module:
        if spec.model.factory:
            return load_ref(spec.model.factory)(**spec.model.options)
        from trainers.workloads.digits import Digits

        return Digits().build_model(spec)

    def loss_sum(self, model: nn.Module, batch) -> tuple[torch.Tensor, int, int]:
        out = model(batch["x"]).float()
        n = batch["y"].shape[0]
        if self.loss == "mse":
            return F.mse_loss(out, batch["y"].float().view_as(out), reduction="sum") / max(out[0].numel(), 1), n, 0
        return F.cross_entropy(out, batch["y"], reduction="sum"), n, 0
