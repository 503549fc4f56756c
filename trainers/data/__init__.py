"""Data: the plan (which samples each step trains on), Parquet streamed by row group, the
sources that turn sample ids into micro-batches, and the per-rank feed that loads them.

Names load with their submodule on first use: a driver that only writes or plans Parquet
(trainers.workloads.datasets) never imports torch, which the loader and the sources need."""

from __future__ import annotations

import importlib

_HOMES = {
    "accounting": "trainers.data.accounting",
    "Feed": "trainers.data.loader", "StepChunks": "trainers.data.loader", "StepDataset": "trainers.data.loader",
    "ParquetFiles": "trainers.data.parquet", "write_parquet": "trainers.data.parquet",
    "BatchPlan": "trainers.data.plan", "Cursor": "trainers.data.plan", "StepMicroBatches": "trainers.data.plan",
    "micro_batches": "trainers.data.plan", "padding_fraction": "trainers.data.plan", "rank_share": "trainers.data.plan",
    "FeatureSource": "trainers.data.sources", "PairsSource": "trainers.data.sources", "TokenSource": "trainers.data.sources",
    "TextSource": "trainers.data.sources",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'trainers.data' has no attribute {name!r}")
    module = importlib.import_module(_HOMES[name])
    return module if name == "accounting" else getattr(module, name)
