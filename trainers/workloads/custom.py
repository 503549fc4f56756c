"""A user's own model and data, trained by our loop: ``model.factory`` and ``data.factory``.

``model.factory`` returns an ``nn.Module`` (called with ``model.options`` as keywords);
``data.factory`` returns a map-style Dataset of ``(input, target)`` pairs (called with
``data.options``), or ``data.source`` names Parquet data with the columns of ``data.columns``
(``features`` and ``label`` by default), streamed by row group.
The loss is ``model.loss`` (cross_entropy or mse) over the module's output.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn
from torch.nn import functional as F

from cluster.storage import StorageRoot
from trainers.config.job import JobSpec
from trainers.data import FeatureSource, PairsSource, ParquetFiles
from trainers.workloads.datasets import prepare_data


def load_ref(ref: str):
    module_name, attr = ref.split(":")
    return getattr(importlib.import_module(module_name), attr)


class CustomWorkload:
    def __init__(self, loss: str = "cross_entropy"):
        self.loss = loss

    def prepare(self, spec: JobSpec, root: StorageRoot) -> str:
        return prepare_data(spec, root)

    def dataset(self, spec: JobSpec, data_uri: str) -> FeatureSource | PairsSource:
        if spec.data.factory:
            return PairsSource(load_ref(spec.data.factory)(**spec.data.options))
        c = spec.data.columns
        return FeatureSource(ParquetFiles(data_uri), c.features, c.label)

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
