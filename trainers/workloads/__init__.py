"""Workloads: what a job trains. Built-in ones ship their data; users bring factories.

A workload knows four things: how to make its Parquet data available under the storage
root (on the driver, once), how to read it (on each worker), how to build the model, and
how to compute the SUMMED loss of a micro-batch, so the loop can scale it to an exact mean
over the global batch whatever the world size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the driver resolves a workload to prepare its data, without torch
    import torch
    from torch import nn

    from cluster.storage import StorageRoot
    from trainers.config.job import JobSpec
    from trainers.data.sources import FeatureSource, PairsSource, TokenSource

    Source = FeatureSource | TokenSource | PairsSource


class Workload(Protocol):
    def prepare(self, spec: JobSpec, root: StorageRoot) -> str:
        """Make the data exist (driver side, once); return its URI for the workers."""

    def dataset(self, spec: JobSpec, data_uri: str) -> Source:
        """The data as a source (``trainers.data.sources``): row groups fetched a micro-batch at a time."""

    def build_model(self, spec: JobSpec) -> nn.Module: ...

    def loss_sum(self, model: nn.Module, batch) -> tuple[torch.Tensor, int, int]:
        """(sum of per-sample losses, samples, real tokens) for one micro-batch."""


def resolve(spec: JobSpec) -> Workload:
    """The workload a spec asks for: a Hugging Face model, a user factory, or the built-in that fits model.name."""
    if spec.model.hf:
        from trainers.workloads.hf import HFWorkload

        return HFWorkload(spec.model.hf.task, spec.model.max_seq_len)
    if spec.model.factory or spec.data.factory:
        from trainers.workloads.custom import CustomWorkload

        return CustomWorkload(loss=spec.model.loss)
    if spec.model.name == "tiny_gpt":
        from trainers.workloads.lm import LanguageModel

        return LanguageModel()
    from trainers.workloads.digits import Digits

    return Digits()
